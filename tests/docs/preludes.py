"""What a docs fragment names without making it: its arrays, its model, its data.

A block marked ``<!-- run: prelude=NAME -->`` runs with PRELUDES[NAME] before it, in the same
script. Keep them small: the block is what is tested, the prelude only lets it run.
"""

from __future__ import annotations

PRELUDES = {
    # The numpy API's fragments: a (rows to split), b (another dtype), g and its residual r, obj.
    "arrays": """
import numpy as np
a = np.arange(24, dtype=np.float32).reshape(8, 3)
b = np.arange(4, dtype=np.int64)
g = np.linspace(-1.0, 1.0, 1000, dtype=np.float32)
r = np.zeros_like(g)
obj = {"epoch": 3}
""",
    # The torch fragments: a small model of the shape the demos train, its optimizer, a loader of
    # three batches, and torch.distributed's rank and world size from the launcher's variables.
    "torch_model": """
import os
import torch
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = torch.nn.CrossEntropyLoss()
loader = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
metric = 0.5
epochs = 2
rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
data = loader
""",
    # The Keras fragments: data of the shape the guide's model takes (20 features, 2 classes), on
    # Keras's torch backend (the keras extra is installed by setup.sh; TensorFlow is not).
    "keras_data": """
import os
os.environ.setdefault("KERAS_BACKEND", "torch")
import numpy as np
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 20)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
""",
    # The numpy DiLoCo fragment: arrays, data and an inner update of the reader's own.
    "diloco_arrays": """
import numpy as np
w0 = np.zeros(1000, dtype=np.float32)
lr = 0.1
data = [np.random.default_rng(i).normal(size=1000).astype(np.float32) for i in range(4)]
def grad(w, batch):
    return w - batch
""",
}
# The fragments that go on from an earlier block of their page: its model, a joined world, and the
# optimizer (opt) that the earlier block made (a DiLoCo with a short round, or a plain one).
PRELUDES["torch_hvd"] = PRELUDES["torch_model"] + """
import ringserve.torch as hvd
hvd.init()
opt = optimizer
"""
PRELUDES["diloco_torch"] = PRELUDES["torch_model"] + """
import ringserve.torch as hvd
hvd.init()
opt = hvd.DiLoCo(model, inner=optimizer, sync_every=2, compression="int8")
steps = 4
"""
# The parameter server's numpy fragment: a linear model's values, its data, and its gradients.
PRELUDES["ps_arrays"] = """
import numpy as np
rng = np.random.default_rng(0)
w, b = np.zeros(8, dtype=np.float32), np.zeros(1, dtype=np.float32)
data = [(rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=16).astype(np.float32)) for _ in range(3)]
def gradients(values, batch):
    x, y = batch
    err = x @ values["w"] + values["b"] - y
    return {"w": (x.T @ err / len(y)).astype(np.float32), "b": np.array([err.mean()], dtype=np.float32)}
"""
