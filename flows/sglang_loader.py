"""Former import path of the in-engine loader, kept for engines launched with it.

New engines use ``--custom-weight-loader tasks.installers.sglang_loader.load_prepared_checkpoint``.
"""

from tasks.installers.sglang_loader import load_prepared_checkpoint  # noqa: F401
