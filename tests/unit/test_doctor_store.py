"""``kvproxy doctor`` checks the shared store's bucket when KVPROXY_STORE_URL is set: reachable,
writable, conditional PUTs honoured; one line each, with the fix. Against a real SeaweedFS."""
from __future__ import annotations

from kvproxy.config import load_settings
from kvproxy.launch.processes import free_port
from kvproxy.ops import doctor
from kvproxy.storage.shared.bucket import Bucket
from kvproxy.storage.shared.location import StoreLocation
from kvproxy.storage.shared.probe import conditional

NO_LLAMA = "http://127.0.0.1:9"


def store_checks(tmp_path, store_url):
    settings = load_settings({}, {"upstream": NO_LLAMA, "slot_dir": str(tmp_path),
                                  "store_url": store_url, "store_timeout": 2})
    checks = doctor.diagnose(settings, None, wait=1)
    return {c.name: c for c in checks if c.name.startswith("store")}, checks


def test_a_good_bucket_passes_every_store_check_and_keeps_no_probe(tmp_path, store_url):
    checks, every = store_checks(tmp_path, store_url)
    assert [c.level for c in checks.values()] == [doctor.OK] * 3, [c.line() for c in every]
    assert "conditional writes are honoured" in checks["store conditions"].text
    location = StoreLocation.parse(store_url)
    assert list(Bucket(location).keys(location.prefix + "/")) == [], "the probe was deleted"
    assert every[0].name == "reachable", "llama-server's checks come first, even when it is down"


def test_no_store_url_no_store_lines(tmp_path):
    checks, _ = store_checks(tmp_path, "")
    assert checks == {}


def test_an_unreachable_store_is_one_failure_with_the_fix(tmp_path, store_url, monkeypatch, weed):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    checks, every = store_checks(tmp_path, store_url)
    assert list(checks) == ["store"] and checks["store"].level == doctor.FAIL
    assert "cannot reach the shared store" in checks["store"].text
    assert "AWS_ENDPOINT_URL" in checks["store"].text and doctor.exit_status(every) == 2
    assert weed.secret_key not in checks["store"].line()


def test_a_wrong_key_is_one_failure_naming_no_credential(tmp_path, store_url, monkeypatch, weed):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123")
    checks, _ = store_checks(tmp_path, store_url)
    line = checks["store"].line()
    assert checks["store"].level == doctor.FAIL and "refused" in line
    for secret in ("not-the-secret-0123", weed.secret_key, weed.access_key):
        assert secret not in line


class IgnoresConditions(Bucket):
    """A bucket client that drops the conditions, as a store that ignores them behaves."""

    def put_if_absent(self, key, body, metadata=None):
        self.put(key, body)
        return True

    def replace(self, key, body, etag, metadata=None):
        self.put(key, body)
        return True


def test_a_store_that_ignores_conditional_puts_fails_the_check(store_url):
    bucket = IgnoresConditions(StoreLocation.parse(store_url), 5)
    bucket.put("p/probe", b"x")
    finding = conditional(bucket, "p/probe")
    assert not finding.ok and "If-None-Match: * and If-Match" in finding.text
