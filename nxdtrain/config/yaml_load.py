"""Reading a ``--config`` file the way NxDT does: with OmegaConf, so interpolation means what it means there.

NxDT (through Hydra) reads its YAML with OmegaConf. Its example configs use three interpolation forms, all
OmegaConf's own: an absolute key (``${trainer.max_steps}``), a key relative to the node holding the value
(``${.encoder_seq_length}``: a sibling), and a resolver with nested interpolations
(``${multiply:${distributed_strategy.tensor_model_parallel_size}, ${distributed_strategy.pipeline_model_parallel_size}}``).
OmegaConf's ``${oc.env:VAR[,default]}`` works as well. The only resolver registered here is NeMo's ``multiply``
(NxDT's files are resolved in NeMo's process, which registers it); nothing in a file is ever executed.

nxdtrain's own flat files also allow a shell-style ``${VAR}`` in a path (expanded later, with ``~`` and ``$VAR``,
by :mod:`nxdtrain.config.options`): a ``${NAME}`` whose NAME is not a top-level key of the file is kept as written.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.yaml"
    >>> _ = path.write_text("a: {n: 3, m: '${multiply:${.n}, 2}'}\\nlr: 3e-4\\n")
    >>> load_tree(path)
    {'a': {'n': 3, 'm': 6}, 'lr': 0.0003}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from nxdtrain.config.extras import require
from nxdtrain.errors import TrainError

# NeMo's resolver that NxDT's example configs use (model_parallel_size: ${multiply:tp, pp}).
RESOLVERS = {"multiply": lambda x, y: x * y}
_SHELL_VAR = re.compile(r"(?<!\\)\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MISSING_KEY = re.compile(r"Interpolation key '([^']*)' not found")


def _register() -> None:
    import omegaconf
    from omegaconf import OmegaConf

    # 2.4 renamed register_new_resolver to register_resolver (2.3's register_resolver is the legacy one)
    new_api = tuple(int(p) for p in omegaconf.__version__.split(".")[:2]) >= (2, 4)
    register = OmegaConf.register_resolver if new_api else OmegaConf.register_new_resolver
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            register(name, fn)


def _keep_shell_vars(value: Any, top: set[str]) -> Any:
    """``${VAR}`` (VAR not a top-level key) escaped, so OmegaConf leaves it for the shell-style expansion."""
    if isinstance(value, dict):
        return {k: _keep_shell_vars(v, top) for k, v in value.items()}
    if isinstance(value, list):
        return [_keep_shell_vars(v, top) for v in value]
    if isinstance(value, str) and "${" in value:
        return _SHELL_VAR.sub(lambda m: m.group(0) if m.group(1) in top else "\\" + m.group(0), value)
    return value


def _raw(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def load_tree(path: Path) -> Any:
    """The file's mapping, every interpolation resolved as OmegaConf resolves it; a one-line TrainError naming the
    file (and the key) otherwise."""
    require("omegaconf", f"--config {path} (read as NxDT reads YAML, with OmegaConf)")
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException
    from yaml import YAMLError

    _register()
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise TrainError(f"--config {path}: no such file") from None
    except (YAMLError, OmegaConfBaseException) as exc:
        raise TrainError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    raw = OmegaConf.to_container(loaded, resolve=False)
    if raw is None or not isinstance(raw, dict):
        return raw
    raw = _keep_shell_vars(raw, {str(k) for k in raw})
    try:
        return OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except InterpolationResolutionError as exc:
        key = str(getattr(exc, "full_key", "") or "")
        text = _raw(raw, key)
        missing = _MISSING_KEY.search(str(exc))
        if missing:
            reason = f"refers to {missing.group(1)}, which the file does not have"
        else:
            reason = str(exc).splitlines()[0]
        raise TrainError(f"--config {path}: {key}: {text!r} {reason}") from None
    except OmegaConfBaseException as exc:
        raise TrainError(f"--config {path}: {str(exc).splitlines()[0]}") from None
