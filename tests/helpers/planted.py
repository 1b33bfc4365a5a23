"""Model directories with one problem planted, for the tests of what a model directory may hold: copies of
accelrun.data.tiny_hf's model with a weight file that runs code, a header or a config.json that lies, custom code,
or a chat template that raises or runs on (planted_copy). Test-only: the generator users run is in the package.
"""

import json
import shutil
from pathlib import Path

from accelrun.data.tiny_hf import with_chat_template

# What tests plant into a copy of the model directory (planted_copy): each a model-directory problem that must end
# in one line before anything loads, and nothing of the directory's runs (issue 46, item 4).
SLOW_TEMPLATE = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{{ bos_token }}"
RAISING_TEMPLATE = "{{ raise_exception('this template refuses every conversation') }}"


class _RunsCode:
    """A pickled object that would call print when unpickled: what weights-only loading refuses."""

    def __reduce__(self):
        return print, ("PLANTED: code from a weight file ran",)


def planted_copy(model_dir, copy_dir, problem, marker=None):
    """A copy of the model directory with one problem planted: "pickle" (pytorch_model.bin with a pickle that runs
    code, no safetensors), "header" (model.safetensors whose header claims 2**62 bytes), "vocab" (config.json with
    vocab_size 10**9), "remote-code" (tokenizer_config.json's auto_map names its evil.py, which writes `marker`),
    "slow-template" or "raising-template" (chat_template.jinja). Returns the copy."""
    import struct

    copy_dir = Path(copy_dir)
    if problem in ("slow-template", "raising-template"):
        return with_chat_template(model_dir, copy_dir, SLOW_TEMPLATE if problem == "slow-template"
                                  else RAISING_TEMPLATE)
    shutil.copytree(model_dir, copy_dir)
    weights = copy_dir / "model.safetensors"
    if problem == "pickle":
        import torch
        from safetensors.torch import load_file
        torch.save({**load_file(weights), "planted": _RunsCode()}, copy_dir / "pytorch_model.bin")
        weights.unlink()
    elif problem == "header":
        weights.write_bytes(struct.pack("<Q", 2 ** 62) + weights.read_bytes()[8:])
    elif problem == "vocab":
        config = json.loads((copy_dir / "config.json").read_text())
        (copy_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 10 ** 9}))
    elif problem == "remote-code":
        tokenizer_config = json.loads((copy_dir / "tokenizer_config.json").read_text())
        tokenizer_config.update(auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]},
                                tokenizer_class="EvilTokenizer")
        (copy_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        (copy_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                          "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    else:
        raise ValueError(problem)
    return copy_dir
