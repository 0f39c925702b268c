"""Key maps (official HF <-> transformers <-> megatron, Mistral's native), HF <-> DCP conversion,
validation, export.

Public entry points (import them from their modules; this package imports nothing heavy):

- ``keys``: ``official_to_transformers_key``, ``transformers_to_official_key``, ``to_transformers_key``,
  ``DCP_MODEL_PREFIX`` (where each DCP layout puts the model keys), ``CONVERSION_LAYOUTS``.
- ``layout``: where things sit on disk: ``DCP_METADATA``, ``MEGATRON_RELEASE_DIR``, ``MEGATRON_TRACKER``,
  ``LATEST``, ``step_dir_name``, ``is_dcp_dir``, ``latest_name``, ``list_checkpoints``, ``checkpoints_dir``.
- ``integrity``: training checkpoints' ``integrity.json`` and the one check every reader makes:
  ``verify_checkpoint``, ``require_intact``, ``newest_intact``.
- ``safe_dcp``: the restricted DCP reader (``SafeFileSystemReader``, ``read_metadata``) and the check
  of a ``.metadata`` against its data files (``storage_problems``).
- ``hf``: a Hugging Face model directory's files (``CONFIG``, ``WEIGHT_INDEX``, ``SINGLE_WEIGHTS``).
- ``hf_to_dcp.convert_hf_to_dcp(model_dir, dcp_dir, layout="fsdp2"|"megatron", progress=None, fsync=False)``
- ``dcp_to_hf.export_dcp_to_hf(dcp_dir, model_dir, out_dir, layout="official"|"transformers", progress=None, fsync=False,
  format="hf"|"mistral")``, ``dcp_to_hf.export_hf_to_native(model_dir, out_dir)`` (Mistral's native layout).
- ``native``: Mistral's native layout (the rotary row order of q/k, params.json and tekken.json beside the weights);
  its names are ``keys``'s (``native_to_transformers_key``), its file names ``hf``'s.
- ``validate.validate_dcp(model_dir, dcp_dir, layout)`` (+ ``require_valid``), ``validate.model_keys(model_dir)``,
  ``validate.resolve_dcp_checkpoint(path, allow_unverified=False)`` (verified: ``integrity``).
"""
