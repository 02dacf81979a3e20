"""Wiring of an encoder (role encoder): the vision tower, the batcher, the embedding cache, a transfer engine and
the two encoder subjects.

Serves `windserve.<ns>.encoder.<id>.{encode,fetch}` (`handlers.EncoderNode`). Its registry entry carries the
transfer address (workers receive embeddings from there) and the cache budget as capacity; health details
list the cache and the batcher. Shutdown: stop serving, drain handlers (in-flight encodes finish), then stop
the batcher, close the transfer engine (fetches in flight fail: the worker's fetch raises) and the threads.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from libs.mm.video import single_threaded_opencv
from libs.model.config import ModelConfig
from libs.model.vision import TINY_VISION_SEED, VisionTower
from libs.model.vision_config import VisionConfig
from libs.model.vision_loader import load_vision_tower
from libs.service import Service
from libs.transfer import KVTransferEngine, advertised_address, create_engine
from protos import subjects
from protos.messages import EmbedFetchRequest, EncodeRequest, RegistryEntry, Role
from services.encoder import metrics
from services.encoder.batcher import DynamicBatcher
from services.encoder.cache import EmbeddingCache
from services.encoder.config import EncoderConfig
from services.encoder.handlers import EncoderNode

log = logging.getLogger("windserve.encoder")


def vision_config(model: str) -> VisionConfig:
    """The model's vision config (the built-in tiny model's when `model` is empty); ValueError for a text-only
    model (an encoder has nothing to do for it)."""
    cfg = ModelConfig.tiny() if not model else ModelConfig.from_pretrained(model)
    if cfg.vision is None:
        raise ValueError(f"model {model or 'tiny'} has no vision_config: it takes no images")
    return cfg.vision


def build_tower(vc: VisionConfig, seed: int = TINY_VISION_SEED, model: str = "", device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> VisionTower:
    """The encoder's tower: the checkpoint's vision weights when `model` names a model directory
    (libs/model/vision_loader.py; a clear CheckpointError when they are missing or do not fit `vc`), else
    deterministic random weights from `seed` (the same in every process, so tests and the bench can run the same
    tower locally)."""
    if model:
        return load_vision_tower(model, vc, dtype, device)
    return VisionTower(vc, seed=seed).to(device=device, dtype=dtype).eval()


class EncoderService(Service):
    role = Role.ENCODER
    config: EncoderConfig

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        self.vc = vision_config(config.model)  # a text-only model fails here, before any IO
        single_threaded_opencv()  # decode parallelism is this service's pools' (libs/mm/video.py)
        self.transfer: KVTransferEngine = create_engine()
        self.tower = build_tower(self.vc, config.tower_seed, config.model, config.encoder_device,
                                 getattr(torch, config.encoder_dtype))
        self.cache = EmbeddingCache(config.cache_bytes, config.lease_s)
        self.batcher: DynamicBatcher | None = None
        self.node: EncoderNode | None = None

    async def setup(self) -> None:
        assert self.bus is not None
        cfg = self.config
        bound = await self.transfer.start(host=cfg.transfer_host, port=cfg.transfer_port)
        self.batcher = DynamicBatcher(self.tower, self.vc, cfg.max_batch_items, cfg.max_batch_patches,
                                      cfg.max_wait_ms / 1000, on_batch=_observe_batch)
        self.batcher.start()
        self.node = EncoderNode(cfg, self.vc, self.cache, self.batcher, self.transfer,
                                advertised_address(bound, cfg.advertise_host),
                                lambda coro, name: self.spawn(coro, name=name))
        ns, iid = cfg.namespace, cfg.instance_id
        await self.bus.serve(subjects.encoder_encode(ns, iid), EncodeRequest, self.node.encode)
        await self.bus.serve(subjects.encoder_fetch(ns, iid), EmbedFetchRequest, self.node.fetch)
        self.node.export_metrics()
        self.spawn(self._upkeep_loop(), name="encoder-upkeep")

    async def teardown(self) -> None:
        try:
            if self.batcher is not None:
                await self.batcher.close()
            await self.transfer.close()
        finally:
            if self.node is not None:
                self.node.close()

    def registry_entry(self) -> RegistryEntry:
        return super().registry_entry().model_copy(update={
            "address": self.node.address if self.node is not None else "",
            "capacity": self.config.cache_bytes,
        })

    def health_details(self) -> dict[str, str]:
        return self.node.details() if self.node is not None else {}

    async def _upkeep_loop(self) -> None:
        """Refresh the cache gauges (leases run out with time, not only on requests)."""
        assert self.node is not None
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            self.node.export_metrics()


def _observe_batch(items: int, patches: int, seconds: float) -> None:
    metrics.BATCH_ITEMS.observe(items)
    metrics.BATCH_PATCHES.observe(patches)
    metrics.TOWER_SECONDS.observe(seconds)
