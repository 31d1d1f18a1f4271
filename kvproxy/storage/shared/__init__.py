"""The shared session store: saved sessions' chunks and manifests copied to an S3 bucket (KVPROXY_STORE_URL)."""
