"""The Kimi K3 model: configuration, the layers, the model, its checkpoints and its tokenizer.

Callers import from here; the modules below are the model's own rooms (config, device, layers, kda, mla, moe, mxfp4,
k3, checkpoint, tokenizer). This package imports nothing else of ours.
"""
from inference.model import mxfp4
from inference.model.checkpoint import (EVERY_TENSOR, CheckpointError, TensorSelection, TensorSite, TensorSpec,
                                        expected_tensors, fingerprint, load_checkpoint, load_tensors,
                                        make_random_checkpoint, random_checkpoint_tensors, read_config, read_manifest,
                                        read_weight_map, state_dict_to_checkpoint_tensors, tensor_site, verify_manifest,
                                        write_checkpoint, write_manifest)
from inference.model.config import ConfigError, ModelConfig
from inference.model.device import (WEIGHT_DTYPES, DeviceError, device_problem, dtype_name, model_device,
                                    resolve_device, resolve_dtype, synchronize)
from inference.model.k3 import KimiK3Model, ResidualState, SequenceCache, check_forward_batch
from inference.model.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "EVERY_TENSOR", "TensorSite", "tensor_site",
    "WEIGHT_DTYPES", "DeviceError", "device_problem", "dtype_name", "model_device", "resolve_device", "resolve_dtype",
    "synchronize",
    "ByteTokenizer", "CheckpointError", "ConfigError", "KimiK3Model", "ModelConfig", "ResidualState",
    "SequenceCache", "TensorSelection", "TensorSpec", "Tokenizer", "TokenizerError", "check_forward_batch",
    "expected_tensors", "fingerprint", "load_checkpoint", "load_tensors", "load_tokenizer",
    "make_random_checkpoint", "mxfp4", "random_checkpoint_tensors", "read_config", "read_manifest",
    "read_weight_map", "state_dict_to_checkpoint_tensors", "verify_manifest", "write_checkpoint",
    "write_manifest",
]
