"""The Keras tests' backend: torch unless KERAS_BACKEND says otherwise (it must be set before keras
is first imported, and the default setup has no TensorFlow)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
