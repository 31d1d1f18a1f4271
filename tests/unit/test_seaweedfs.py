"""What the shared store relies on in SeaweedFS's S3 API, shown against a real ``weed mini``:
conditional PUTs (If-None-Match: * for chunks, If-Match on the ETag for manifests), atomic
under a race, and user metadata read back by HEAD."""
from __future__ import annotations

import concurrent.futures

import botocore.exceptions
import pytest


def status_of(call) -> int:
    try:
        call()
    except botocore.exceptions.ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"]
    return 200


@pytest.fixture
def bucket(weed):
    return weed.client(), weed.new_bucket()


def test_put_if_absent_on_an_existing_key_answers_412_and_keeps_the_first(bucket):
    s3, name = bucket
    assert status_of(lambda: s3.put_object(Bucket=name, Key="k", Body=b"one", IfNoneMatch="*")) == 200
    assert status_of(lambda: s3.put_object(Bucket=name, Key="k", Body=b"two", IfNoneMatch="*")) == 412
    assert s3.get_object(Bucket=name, Key="k")["Body"].read() == b"one"


def test_put_if_match_replaces_only_the_object_it_names(bucket):
    s3, name = bucket
    first = s3.put_object(Bucket=name, Key="m", Body=b"one")["ETag"]
    assert status_of(lambda: s3.put_object(Bucket=name, Key="m", Body=b"two", IfMatch=first)) == 200
    # the ETag of the replaced object no longer matches; nor does any ETag a missing key
    assert status_of(lambda: s3.put_object(Bucket=name, Key="m", Body=b"three", IfMatch=first)) == 412
    assert status_of(lambda: s3.put_object(Bucket=name, Key="none", Body=b"x", IfMatch=first)) == 412
    assert s3.get_object(Bucket=name, Key="m")["Body"].read() == b"two"


@pytest.mark.parametrize("condition", ["IfNoneMatch", "IfMatch"])
def test_racing_conditional_puts_have_one_winner(bucket, condition):
    s3, name = bucket
    etag = s3.put_object(Bucket=name, Key="base", Body=b"base")["ETag"]
    key, value = ("new", "*") if condition == "IfNoneMatch" else ("base", etag)

    for race in range(3):
        # Bodies differ from every earlier one: an ETag is the body's MD5, so a writer of the
        # very bytes already there would match it again (the manifests' bodies carry their
        # generation, so two of them never share an ETag).
        def put(i: int) -> int:
            body = b"race %d writer %d " % (race, i) * 512
            return status_of(lambda: s3.put_object(Bucket=name, Key=key, Body=body,
                                                   **{condition: value}))
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(put, range(6)))
        assert sorted(answers) == [200] + [412] * 5
        key, value = (f"new{race}", "*") if condition == "IfNoneMatch" else \
            ("base", s3.head_object(Bucket=name, Key="base")["ETag"])


def test_head_reads_back_user_metadata(bucket):
    s3, name = bucket
    s3.put_object(Bucket=name, Key="m", Body=b"x", Metadata={"generation": "17"})
    head = s3.head_object(Bucket=name, Key="m")
    assert head["Metadata"] == {"generation": "17"}
    assert head["ContentLength"] == 1


def test_an_etag_is_the_bodys_md5_so_the_same_bytes_match_it_again(bucket):
    """Why a manifest's body carries its generation: a compare-and-swap on the ETag cannot
    tell two writes of the same bytes apart."""
    s3, name = bucket
    first = s3.put_object(Bucket=name, Key="m", Body=b"same")["ETag"]
    assert status_of(lambda: s3.put_object(Bucket=name, Key="m", Body=b"same", IfMatch=first)) == 200
    assert status_of(lambda: s3.put_object(Bucket=name, Key="m", Body=b"same", IfMatch=first)) == 200
