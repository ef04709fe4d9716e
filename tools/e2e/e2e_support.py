"""What every client check under tools/e2e shares: the failure type, `check`, and the API root from the command line."""

import os


class CheckFailure(Exception):
    """A check that did not hold."""


def check(condition, message):
    if not condition:
        raise CheckFailure(message)


def base_url_from(argv, usage):
    """The API root from argv[1] or DFLASH_BASE_URL, ending in /v1; `usage` is printed when neither is given."""
    url = argv[1] if len(argv) > 1 else os.environ.get("DFLASH_BASE_URL", "")
    if not url:
        raise SystemExit(usage)
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"
