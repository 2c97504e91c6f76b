"""Fixtures for the whole suite: the learners the tests start never read a developer's own link
advice (`dilocod bench run` saves it under ~/.config); every process the tests start inherits an
advice path of the session's own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _own_link_advice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    previous = os.environ.get("DILOCOD_ADVICE")
    os.environ["DILOCOD_ADVICE"] = str(tmp_path_factory.mktemp("advice") / "link-advice.json")
    yield
    if previous is None:
        os.environ.pop("DILOCOD_ADVICE", None)
    else:
        os.environ["DILOCOD_ADVICE"] = previous
