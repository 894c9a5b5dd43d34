"""Shared test configuration.

Async tests marked ``@pytest.mark.anyio`` run on both asyncio and trio through anyio's
pytest plugin; tests that need asyncio specifics (``Task.cancel``) use pytest-asyncio.
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run each anyio test once per backend."""
    return str(request.param)
