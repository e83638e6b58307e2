"""ringserve.keras: Horovod's Keras API for Keras 3, on the TensorFlow and the torch backends.

A script written for ``horovod.tensorflow.keras`` runs after changing its import:

```python
import ringserve.keras as hvd

hvd.init()
model = keras.Sequential([...])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x, y, batch_size=32, epochs=5,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback()],
          verbose=1 if hvd.rank() == 0 else 0)
```

The backend is Keras's own choice (``KERAS_BACKEND=torch`` or ``tensorflow``, read when keras is
first imported). Unlike Horovod's binding, which takes only legacy Keras 2 optimizers, any Keras 3
optimizer can be wrapped. Elastic training is ``hvd.elastic`` (``KerasState``, ``run`` and the
commit callbacks).

Needs ``pip install ringserve[keras]`` (and torch, or ``ringserve[tensorflow]``); without keras,
importing this module raises an ImportError that names the extra.
"""

from __future__ import annotations

from ringserve.bindings import require

require("keras", "keras")

from ringserve.bindings import (  # noqa: E402
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ringserve.errors import HostsUpdatedInterrupt  # noqa: E402
from ringserve.errors import RecoverableError as HorovodInternalError  # noqa: E402
from ringserve.keras import callbacks, elastic  # noqa: E402
from ringserve.keras.callbacks import broadcast_variables  # noqa: E402
from ringserve.keras.collectives import (  # noqa: E402
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    grouped_allreduce,
    reducescatter,
)
from ringserve.keras.optimizer import DistributedOptimizer  # noqa: E402
from ringserve.keras.saving import load_model  # noqa: E402
from ringserve.worker.ops.process_sets import ProcessSet  # noqa: E402

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "rocm_built",
    "shutdown",
    "size",
]
