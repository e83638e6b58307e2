"""ringserve.tensorflow: Horovod's TensorFlow API on tf.Tensor, over ringserve's core.

A script written for ``horovod.tensorflow`` runs after changing its import:

```python
import ringserve.tensorflow as hvd

hvd.init()
with tf.GradientTape() as tape:
    loss = loss_fn(y, model(x))
tape = hvd.DistributedGradientTape(tape)
grads = tape.gradient(loss, model.trainable_variables)
```

Collectives (``allreduce``, ``grouped_allreduce``, ``allgather``, ``broadcast``, ``reducescatter``)
work eagerly and inside ``tf.function`` (as ``tf.numpy_function`` ops; see _host.py for the cost).
For ``model.fit``, use ``ringserve.keras``.

Needs ``pip install ringserve[tensorflow]``; without TensorFlow, importing this module raises an
ImportError that names the extra.
"""

from __future__ import annotations

from ringserve.bindings import require

require("tensorflow", "tensorflow")

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
from ringserve.tensorflow.collectives import (  # noqa: E402
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    grouped_allreduce,
    reducescatter,
)
from ringserve.tensorflow.gradient_tape import DistributedGradientTape, broadcast_variables  # noqa: E402
from ringserve.worker.ops.process_sets import ProcessSet  # noqa: E402

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedGradientTape",
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
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "init",
    "is_initialized",
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
