"""The job's certificates, made once per test session (see _secure.py)."""

from __future__ import annotations

import pytest
from _secure import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
