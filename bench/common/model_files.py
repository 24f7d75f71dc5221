"""Where the studies' models are: the random models' shapes (``bench/configs/models.yaml``) and the folder
``make model`` prepares SmolLM2-135M-Instruct in (relative, as the README's commands name it)."""

from __future__ import annotations

from pathlib import Path

MODELS_YAML = Path(__file__).resolve().parents[1] / "configs" / "models.yaml"
SMOLLM2_DIR = Path("models") / "SmolLM2-135M-Instruct"
