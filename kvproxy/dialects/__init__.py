"""Client API dialects: each translates its wire format to and from a neutral ``ChatCall``."""
