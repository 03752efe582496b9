"""The environment for a child Python that must import this checkout."""
import os
from pathlib import Path

REPO = Path(__file__).parents[1]


def repo_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH and the caller's entries kept after
    it (wheels unpacked beside a system torch, say, as scripts/check_cuda.sh runs), plus `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)
