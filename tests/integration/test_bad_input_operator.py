"""Bad input at the operator's side (the CLI, the console, what they print): each is refused
with a typed error or shown redacted, and nothing recorded changes (issue 24's list)."""

from __future__ import annotations

import json

import pytest

from poimen import Kernel
from poimen.errors import StoreError
from tests.integration.operator_app import poimen

PASSWORD = "Sw0rdf1sh-secret"
FOREIGN = [
    f"mysql://agent:{PASSWORD}@db.example/agent",
    f"postgressql://agent:{PASSWORD}@db.example/agent",
    f"postgresql:/agent:{PASSWORD}@db.example/agent",
    f"host=db.example user=agent password={PASSWORD} dbname=agent",
    f"postgres//agent:{PASSWORD}@db.example/agent?sslpassword={PASSWORD}",
]


@pytest.mark.parametrize("url", FOREIGN)
def test_a_foreign_or_mistyped_store_url_is_never_printed_with_its_password(url: str) -> None:
    for args in (("status",), ("status", "--json"), ("doctor",), ("doctor", "--json")):
        r = poimen(*args, db=url)
        assert r.returncode == 3, (args, r.returncode, r.stderr)
        assert PASSWORD not in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "[redacted]" in r.stdout + r.stderr or "[url]" in r.stdout + r.stderr
    j = json.loads(poimen("status", "--json", db=url).stdout)
    assert j["error"]["type"] == "StoreError" and PASSWORD not in json.dumps(j)
    with pytest.raises(StoreError) as e:
        Kernel(url)
    assert PASSWORD not in str(e.value) and PASSWORD not in repr(e.value.data)
    assert "unsupported store URL" in str(e.value)
