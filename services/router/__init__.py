"""The router role (docs/router.md). Its hot modules load compiled where a build of the
current sources exists (services/router/native.py)."""
from services.router.native import use_compiled

use_compiled(__name__, __path__)
