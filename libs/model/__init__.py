"""MiMo-V2 model: config, paged-KV decoder (+MTP), checkpoint loading, tokenizer."""

from libs.model.config import ModelConfig
from libs.model.loader import CheckpointError, load_model
from libs.model.model import MiMoV2Model
from libs.model.paged import BatchMeta, KVPools
from libs.model.tokenizer import Tokenizer, load_tokenizer

__all__ = ["BatchMeta", "CheckpointError", "KVPools", "MiMoV2Model", "ModelConfig", "Tokenizer", "load_model",
           "load_tokenizer"]
