"""Data planes: how payload bytes move once the control connection announced a LAYER.

``base.py`` is the seam (``DataPlane``, ``Link``); ``tcp.py`` sends payloads inline on the control
stream; ``ucx.py`` sends them as UCX tagged messages between the engines' ``ucxx`` workers.
This package imports no engine code, so the engine can import every backend.
"""
