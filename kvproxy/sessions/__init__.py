"""Which session a request belongs to: pure functions over untrusted ids and bodies."""
