"""`python -m services.encoder`: an encoder (vision tower + embedding cache), configuration from WINDSERVE_* env."""

from libs.service import main
from services.encoder.config import EncoderConfig

if __name__ == "__main__":
    raise SystemExit(main("services.encoder.service:EncoderService", EncoderConfig))
