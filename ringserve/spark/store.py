"""Where the Spark estimators keep their data, checkpoints and logs: a directory named by URL.

``Store.create(path)`` (or ``Store(path)``) picks the filesystem by the URL's scheme with fsspec: a
local directory or ``file://`` URL, and any scheme fsspec knows (``s3://``, ``gs://``, ``hdfs://``,
``abfs://``, ... with that filesystem's package installed). The layout, as Horovod's:

```python
<prefix>/intermediate_train_data.<run_id>/   Parquet written by fit(df), read by the ranks
<prefix>/intermediate_val_data.<run_id>/
<prefix>/runs/<run_id>/checkpoint.<ext>      the model after each epoch, written by rank 0
<prefix>/runs/<run_id>/history.json          the per-epoch metrics
```

Spark writes the Parquet through its own (Hadoop) filesystems, so a store a Spark job writes to
must be a URL Spark can write too: a local path (on a cluster, one every executor sees at the same
path), ``hdfs://``, ``s3a://`` and so on. The ranks read it, and the driver and rank 0 write the
checkpoints, through fsspec.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any

from ringserve.atomic import write_atomic_fs
from ringserve.bindings import require
from ringserve.errors import InvalidArgumentError

__all__ = ["LocalStore", "Store"]


class Store:
    """A directory for an estimator's data and runs, on any filesystem fsspec can reach.

    Args:
        prefix_path: a local directory, or a URL (``file:///data/store``, ``s3://bucket/store``).
        **storage_options: passed to the fsspec filesystem (credentials, endpoints).

    Example:
        ```python
        store = ringserve.spark.Store.create("/tmp/rs-store")
        est = TorchEstimator(..., store=store)
        ```
    """

    def __init__(self, prefix_path: str, **storage_options: Any) -> None:
        if not isinstance(prefix_path, str) or not prefix_path:
            raise InvalidArgumentError(f"A store needs a directory path or URL, not {prefix_path!r}.")
        fsspec = require("fsspec", "spark")
        self.storage_options = dict(storage_options)
        self.fs, path = fsspec.core.url_to_fs(prefix_path, **storage_options)
        self.local = "file" in _protocols(self.fs)
        self.prefix_path = os.path.abspath(path) if self.local else prefix_path.rstrip("/")
        self._root = self.prefix_path if self.local else path.rstrip("/")

    @staticmethod
    def create(prefix_path: str, **storage_options: Any) -> Store:
        """The store at ``prefix_path``, its filesystem picked by the URL (Horovod's ``Store.create``)."""
        return Store(prefix_path, **storage_options)

    def __reduce__(self) -> tuple[Any, ...]:
        # Tasks get the URL and options, and open the filesystem themselves.
        return _restore, (self.prefix_path, self.storage_options)

    def __repr__(self) -> str:
        return f"Store({self.prefix_path!r})"

    # -- paths -----------------------------------------------------------------------------------

    def _join(self, *parts: str) -> str:
        return posixpath.join(self._root, *parts) if not self.local else os.path.join(self._root, *parts)

    def get_train_data_path(self, idx: str | None = None) -> str:
        return self._join(f"intermediate_train_data.{idx}" if idx is not None else "intermediate_train_data")

    def get_val_data_path(self, idx: str | None = None) -> str:
        return self._join(f"intermediate_val_data.{idx}" if idx is not None else "intermediate_val_data")

    def get_runs_path(self) -> str:
        return self._join("runs")

    def get_run_path(self, run_id: str) -> str:
        return self._join("runs", run_id)

    def get_checkpoint_path(self, run_id: str, ext: str) -> str:
        return self._join("runs", run_id, f"checkpoint.{ext}")

    def get_history_path(self, run_id: str) -> str:
        return self._join("runs", run_id, "history.json")

    def spark_url(self, path: str) -> str:
        """The path as a URL Spark's writers take (``file://`` for a local one)."""
        if self.local:
            return "file://" + path
        protocol = _protocols(self.fs)[0]
        return path if "://" in path else f"{protocol}://{path}"

    # -- files ------------------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return bytes(f.read())

    def write(self, path: str, data: bytes) -> None:
        """Writes ``data`` to ``path`` whole: to a temporary name first, then moved over it, so that a
        reader never sees half a checkpoint."""
        parent = posixpath.dirname(path) if not self.local else os.path.dirname(path)
        self.fs.makedirs(parent, exist_ok=True)
        write_atomic_fs(self.fs, path, data)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def check_writable(self) -> None:
        """Writes and removes a small file under the prefix.

        Raises:
            InvalidArgumentError: the store cannot be written (named, with the filesystem's reason).
        """
        probe = self._join(f".ringserve-probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self._root, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except (OSError, PermissionError, ValueError) as e:
            raise InvalidArgumentError(f"The store {self.prefix_path!r} cannot be written: {e}") from e


class LocalStore(Store):
    """A store in a local directory (on a cluster, one every executor sees at the same path)."""

    def __init__(self, prefix_path: str) -> None:
        super().__init__(prefix_path)
        if not self.local:
            raise InvalidArgumentError(f"LocalStore takes a local directory, not {prefix_path!r}; use Store.create.")


def _restore(prefix_path: str, storage_options: dict[str, Any]) -> Store:
    return Store(prefix_path, **storage_options)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
