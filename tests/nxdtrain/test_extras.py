"""A missing optional package (pyproject.toml's extras) stops its feature in one line naming the feature, the package
and ``pip install 'ckptconv[EXTRA]'``: each simulated absent in a subprocess by a meta-path finder that refuses it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} or name.startswith({module!r} + "."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def blocked(module: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK.format(module=module) + code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def last_line(run: subprocess.CompletedProcess[str]) -> str:
    lines = run.stderr.strip().splitlines()
    assert lines, run
    return lines[-1]


def test_omegaconf_missing_stops_config_before_any_process(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("resume: /x\ndata: synthetic\n")
    run = blocked("omegaconf", "from nxdtrain.cli import main\nsys.exit(main(['run', '--config', "
                               f"{str(path)!r}, '--nproc', '2', '--no-checkpoint']))")
    assert run.returncode != 0
    assert run.stderr.count("\n") <= 1 and "Traceback" not in run.stderr, run.stderr
    assert last_line(run).endswith(f"--config {path} (read as NxDT reads YAML, with OmegaConf) needs the omegaconf "
                                   "package: pip install 'ckptconv[train]'")


FUNCTIONS = {
    # module: (call in the subprocess, the line)
    "datasets": ("from nxdtrain.data.rows import load_column; load_column(Path('/tmp/rows'), 'input_ids')",
                 "--data /tmp/rows (a save_to_disk dataset) needs the datasets package: pip install 'ckptconv[train]'"),
    "tensorboard": ("from nxdtrain.metrics import require_tensorboard; require_tensorboard()",
                    "--tensorboard needs the tensorboard package: pip install 'ckptconv[viz]'"),
    "matplotlib": ("from nxdtrain.plot import plot_log; plot_log(LOG, '/tmp/never.png')",
                   "nxdtrain plot needs the matplotlib package: pip install 'ckptconv[viz]'"),
    "transformers": ("from nxdtrain.data.pack import load_tokenizer; load_tokenizer(str(TOK))",
                     "--tokenizer {tok} (a tokenizer directory) needs the transformers package: "
                     "pip install 'ckptconv[hf]'"),
    "torch_xla": ("from nxdtrain.device import resolve_kind; resolve_kind('xla')",
                  "--device xla: torch_xla does not import here (install torch-xla matching this torch, or "
                  "torch-neuronx on Trainium; `make setup-xla` builds such an environment)"),
}


@pytest.mark.parametrize("module", list(FUNCTIONS))
def test_missing_extra_is_one_line_naming_feature_package_and_extra(tmp_path, module):
    call, line = FUNCTIONS[module]
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0}) + "\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    run = blocked(module, f"from pathlib import Path\nLOG, TOK = {str(log)!r}, Path({str(tok)!r})\n"
                          "from nxdtrain.errors import TrainError\n"
                          f"try:\n    {call}\nexcept TrainError as exc:\n    print(exc, file=sys.stderr); sys.exit(2)\n")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == line.format(tok=tok)
