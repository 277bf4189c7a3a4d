"""Fixtures of the model tests: the CPU packages that later modules load, compiled in the
background from the first AOTI module on (tests/models/aoti_prebuild.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.models.aoti_fixtures import tiny_model_dir
from tests.models.aoti_prebuild import BUILDS, Prebuilds

_WAITED_FOR = pytest.StashKey[set[str]]()


@pytest.hookimpl(trylast=True)  # after -k and -m took out what does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The builds this session waits for: those whose ``<name>_prebuilt`` a test uses."""
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    config.stash[_WAITED_FOR] = {name for name in BUILDS if f"{name}_prebuilt" in used}


@pytest.fixture(scope="session")
def aoti_prebuilds(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prebuilds]:
    """The build processes, started once per session for the same deterministic tiny
    model, so the packages that the tests' own model directories key to."""
    names = request.config.stash.get(_WAITED_FOR, set(BUILDS))
    root = tmp_path_factory.mktemp("prebuild")
    builds = Prebuilds(names, tiny_model_dir(root / "tiny"), root)
    try:
        yield builds
    finally:
        builds.stop()


@pytest.fixture(scope="session")
def serving_prebuilt(aoti_prebuilds: Prebuilds) -> None:
    """The serving package's background build has ended (test_aoti_runtime.py)."""
    aoti_prebuilds.wait("serving")


@pytest.fixture(scope="session")
def fp8_prebuilt(aoti_prebuilds: Prebuilds) -> None:
    """The FP8 package's background build has ended (test_quantization.py)."""
    aoti_prebuilds.wait("fp8")
