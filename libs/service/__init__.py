"""Service base: config loading, JSON logging, metrics endpoint, lifecycle with graceful shutdown."""

from libs.service.config import (
    ConfigError,
    SenderServiceConfig,
    ServiceConfig,
    TransferServiceConfig,
    env_name,
    load_config,
)
from libs.service.logs import JsonFormatter, setup_logging
from libs.service.service import Service, main

__all__ = [
    "ConfigError",
    "JsonFormatter",
    "Service",
    "SenderServiceConfig",
    "ServiceConfig",
    "TransferServiceConfig",
    "env_name",
    "load_config",
    "main",
    "setup_logging",
]
