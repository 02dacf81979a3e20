"""`python -m services.encoder`: an encoder (vision tower + embedding cache), configuration from WINDSERVE_* env."""

from libs.service import main
from services.encoder.config import EncoderConfig
from services.encoder.service import EncoderService

if __name__ == "__main__":
    raise SystemExit(main(EncoderService, EncoderConfig))
