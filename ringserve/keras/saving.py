"""``hvd.load_model``: a saved model whose optimizer comes back wrapped in a DistributedOptimizer."""

from __future__ import annotations

from typing import Any

import keras

from ringserve.keras.optimizer import DistributedOptimizer


def load_model(filepath: str, custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: object = None) -> keras.Model:
    """Loads a model saved by ``model.save(...)`` (a .keras file) and wraps its optimizer, if it has
    one and it is not wrapped already, in a DistributedOptimizer, as Horovod's ``load_model`` does.

    Args:
        filepath: the saved model.
        custom_optimizers: optimizer classes of your own that the file names.
        custom_objects: other objects of your own (layers, losses) that the file names.
        compression: the DistributedOptimizer's compression (Compression.none by default).
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.saving.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        kwargs: dict[str, Any] = {} if compression is None else {"compression": compression}
        model.optimizer = DistributedOptimizer(optimizer, **kwargs)
    return model
