"""Shared helpers of the fault and security suites (kept here so they do not depend on other test modules)."""

from __future__ import annotations

import json
from pathlib import Path

PAIRS = [
    {"prompt": "What is the boiling point of water?", "wanted": "100 °C.",
     "unwanted": "Great question! Water boils at 100 degrees Celsius at sea level, or 212 °F."},
    {"prompt": "How many legs does a spider have?", "wanted": "Eight.",
     "unwanted": "Spiders are arachnids, and like all arachnids they have eight legs in total."},
    {"prompt": "Who wrote Hamlet?", "wanted": "Shakespeare.",
     "unwanted": "Hamlet was written by William Shakespeare around 1600; it is a famous tragedy."},
]


def small_spec(folder: Path, **defaults: object) -> Path:
    """A tiny behaviour spec for `blaze edit` on the tiny fixture (fixed strength 0.1 unless `defaults` say
    otherwise, no gate on the effect); also used by tests/test_build.py."""
    spec = {
        "name": "tiny-concise", "version": 1, "description": "Test behaviour: shorter answers.",
        "directions": [{"name": "concise",
                        "pairs": {"train": PAIRS,
                                  "validation": [{"prompt": "What is 2+2?", "keywords": ["4", "four"]}]}}],
        "heldout": [{"prompt": "What is the capital of France?", "keywords": ["Paris"]}],
        "preserve": ["Write a haiku about rain."],
        "quality": "keywords",
        "defaults": {"method": "steer", "kinds": ["writers"], "layers": "2-4", "rank": 1, "strength": 0.1,
                     "strength_grid": [0.05, 0.1], "lambda": 1.0, "threshold": 0.01, "max_new_tokens": 8,
                     **defaults},
        "gate": {"min_effect": 0.0, "effect": "none"},
    }
    path = Path(folder) / "tiny-concise.json"
    path.write_text(json.dumps(spec))
    return path
