"""Lock files, downloads through huggingface_hub, the SHA-256 manifest and verification.

Entry points for other parts of the package:

* ``fetch_assets(model_dir, lock=None, *, weights=True, tokenizer_source="official",
  verify_only=False)`` -> ``FetchReport`` (``.ok``, ``.files``, ``.raise_for_failures()``);
* ``verify_model_dir(model_dir, lock=None)``: offline check that raises ``CheckFailed``;
* ``load_lock(path=None)`` (``None``: the packaged Magistral-Small-2509 lock);
* ``read_manifest(model_dir)`` -> ``{name: ManifestEntry}``;
* ``sha256_file(path)`` / ``sha256_files(paths)``: streamed, several files in parallel.

Importing this package does not import ``huggingface_hub``; downloads import it when they run.
"""

from .fetch import FetchReport, FileResult, fetch_assets, verify_model_dir
from .hashing import sha256_file, sha256_files
from .lock import AssetLock, LockedFile, load_lock
from .manifest import MANIFEST_NAME, ManifestEntry, read_manifest

__all__ = [
    "MANIFEST_NAME",
    "AssetLock",
    "FetchReport",
    "FileResult",
    "LockedFile",
    "ManifestEntry",
    "fetch_assets",
    "load_lock",
    "read_manifest",
    "sha256_file",
    "sha256_files",
    "verify_model_dir",
]
