"""How the attack tests rewrite a checkpoint's files: shared by test_integrity.py and test_hostile_checkpoint_dir.py."""

import io
import zipfile


def deflated(torch_zip):
    """The bytes of a torch zip (a whole file, or one slice of a .distcp) rewritten with the same entries stored
    deflate-compressed: a few MB that could inflate to GB."""
    with zipfile.ZipFile(io.BytesIO(torch_zip)) as plain:
        entries = [(info.filename, plain.read(info)) for info in plain.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as packed:
        for name, content in entries:
            packed.writestr(name, content)
    return buffer.getvalue()
