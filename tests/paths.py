"""Where the project's shared data lives: `shared/` beside the repository (CI and developers) or inside it
(the GPU machine, where it is copied in)."""

from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
SHARED_DIR = next(
    (p for p in (REPO_DIR.parent / "shared", REPO_DIR / "shared") if p.is_dir()), REPO_DIR.parent / "shared"
)
SMOLLM2_TOKENIZER_DIR = SHARED_DIR / "tokenizers" / "smollm2"
FIXTURES_DIR = SHARED_DIR / "fixtures"
MODELS_DIR = SHARED_DIR / "models"
