"""Session-wide test fixtures: a tiny random-weight Clef release, a loaded runtime for it, and smollm2.

Everything is built in-process and offline: `HF_HUB_OFFLINE=1` is set before any Hugging Face import,
so a test that would reach the network fails loudly instead. The tiny release is built once per session
with a fixed seed, so every test sees the same bytes.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("BLAZE_QUIET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests must not fill the user's hash cache (~/.cache/blaze/sha256-cache.json) with entries for temporary
# files; the tests of the cache itself switch it on in a private BLAZE_CACHE.
os.environ["BLAZE_HASH_CACHE"] = "0"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The test machines are small and shared: several OpenMP threads per process spin against each other and
# made CPU forwards ~6x slower than one thread (measured on SmolLM2 under load). BLAZE_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("BLAZE_TEST_THREADS", "1")))

TINY_SEED = 0


@pytest.fixture(scope="session", autouse=True)
def _private_blaze_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every blaze cache (embedded conversions, statistics, the base answers `blaze edit` and `blaze canary`
    keep on disk) goes to a folder of this session: a test never reuses what another run, or the user's own
    `blaze` runs, left behind. Costs one SmolLM2 conversion per session. BLAZE_TEST_CACHE names a folder to
    keep between sessions instead (a local speed-up; CI never sets it)."""
    folder = os.environ.get("BLAZE_TEST_CACHE") or str(tmp_path_factory.mktemp("blaze-cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLAZE_CACHE", folder)
        yield Path(folder)


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny random-weight Clef-Flash release (exact release layout), built once per session."""
    from clef_model.fixtures import build_fixture

    return build_fixture(tmp_path_factory.mktemp("fixtures") / "tiny", "tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_runtime(tiny_release: Path):
    """A `Runtime` for the tiny release, loaded once on CPU in float32 (do not leave weights edited)."""
    import torch

    from clef_model.runtime import Runtime

    return Runtime.load(str(tiny_release), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct release folder (converted once, cached). Mark users `slow`."""
    from clef_model.embedded import embedded_release_path

    return embedded_release_path()
