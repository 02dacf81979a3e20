"""Multimodal inputs (#16): image / video sizing, content hashes, the token view that carries an image's identity
through the prefix cache, and (by the encoder tier) decoding, preprocessing and the encoder client."""
