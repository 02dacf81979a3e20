"""Wiring of the router service: registry + health today; its request handlers come later."""

from libs.service import Service
from protos.messages import Role
from services.router import handlers
from services.router.config import RouterConfig


class RouterService(Service):
    role = Role.ROUTER
    config: RouterConfig

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
