"""The documentation holds together: README stays a front page, its links resolve, and every
summary.json key the recipes write is defined in docs/measuring.md. Quick: reads files only."""

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = ["configs", "slurm", "checkpoints", "measuring", "troubleshooting"]  # issue #13
README_MAX_LINES = 260

# Every key the recipes write into summary.json (recipes/runkit/run.py, reporting.py, timing.py and
# the recipes' own extras), each of which docs/measuring.md must define under "Summary fields".
SUMMARY_KEYS = [
    # identity
    "recipe", "distributed_type", "world_size", "mixed_precision", "deepspeed_stage", "offload_optimizer",
    "optimizer", "data_source", "grad_reduce_dtype", "overlap_comm",
    # progress, losses, evaluation
    "steps", "epochs", "resumed_from_step", "first_loss", "final_loss",
    "test_loss", "test_accuracy", "test_samples", "val_accuracy", "val_images", "val_loss",
    # speed and time
    "samples_per_s", "tokens_per_s", "images_per_s", "mfu", "data_time_s", "compute_time_s", "data_fraction",
    "timing", "data_ms", "forward_backward_ms", "optimizer_ms", "other_ms", "optimizer_in_backward",
    "micro_batches", "first_step_at", "wall_time_s",
    # memory and parameters
    "peak_memory_mb", "peak_memory_mb_per_rank", "peak_memory_kind", "param_elements",
    "param_elements_per_rank", "param_checksum_per_rank", "fsdp_units", "model_init",
    "host_peak_gb_at_start_per_rank", "device_peak_gb_at_start_per_rank",
    # checkpoints
    "checkpoints", "saves", "save_write_s", "save_checksum_s", "resume_verify_s", "resume_load_s",
    # recipe extras and arguments
    "preset", "block_size", "train_blocks", "model_state_gb_per_process_estimate", "sample",
    "arch", "image_size", "classes", "base_model", "data_format", "train_examples", "loss_positions_share",
    "gradient_checkpointing", "exported_dtype", "sample_prompt", "sample_prompt_ids", "sample_token_ids",
    "sample_logprobs", "args",
]

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\".*\")?\s*$", re.M)
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def markdown_files():
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text):
    """The text without fenced code blocks and inline code, where brackets are not links."""
    kept, fenced = [], None
    for line in text.splitlines():
        fence = re.match(r"\s{0,3}(```+|~~~+)", line)
        if fence and (fenced is None or fence.group(1)[0] == fenced[0] and len(fence.group(1)) >= len(fenced)):
            fenced = None if fenced else fence.group(1)
            kept.append("")
            continue
        kept.append("" if fenced else CODE_SPAN.sub("", line))
    return "\n".join(kept)


def links(path):
    text = prose(path.read_text(encoding="utf-8"))
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings_raw(path):
    """Headings with their code spans kept (prose() removes code spans, which headings may hold)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"\s{0,3}(```|~~~)", line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            out.append(match.group(1))
    return out


def anchor_set(path):
    found, seen = set(), {}
    for heading in headings_raw(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it a front page (at most {README_MAX_LINES}) and move depth to docs/")


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_exists_and_is_linked_from_readme(page):
    path = DOCS / f"{page}.md"
    assert path.is_file(), f"docs/{page}.md is missing"
    targets = {urlparse(t).path for t in links(README)}
    assert f"docs/{page}.md" in targets, f"README.md does not link docs/{page}.md"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(path):
    problems = []
    for target in links(path):
        parsed = urlparse(target)
        if parsed.scheme in ("http", "https", "mailto"):
            # A link to this repository's own files on a forge breaks on forks and branches: use a relative one.
            parts = parsed.path.split("/")
            if parsed.netloc.endswith("github.com") and len(parts) > 5 and parts[3] in ("blob", "tree") \
                    and (REPO / "/".join(parts[5:])).exists():
                problems.append(f"{target}: absolute link to a file of this repository; use a relative link")
            continue
        if parsed.scheme or target.startswith("/"):
            problems.append(f"{target}: absolute link; use a path relative to {path.name}")
            continue
        file = path if not parsed.path else (path.parent / unquote(parsed.path)).resolve()
        if not file.exists():
            problems.append(f"{target}: {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not exist")
            continue
        if not file.is_relative_to(REPO):
            problems.append(f"{target}: points outside the repository")
        elif parsed.fragment and file.suffix == ".md" and parsed.fragment not in anchor_set(file):
            problems.append(f"{target}: no heading #{parsed.fragment} in {file.relative_to(REPO)}")
    assert not problems, f"{path.relative_to(REPO)}:\n  " + "\n  ".join(problems)


def test_every_summary_key_is_defined_in_measuring():
    text = (DOCS / "measuring.md").read_text(encoding="utf-8")
    match = re.search(r"^## Summary fields\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, 'docs/measuring.md has no "## Summary fields" section'
    section = match.group(1)
    missing = [key for key in SUMMARY_KEYS if f"`{key}`" not in section]
    assert not missing, f'not defined under "Summary fields" in docs/measuring.md: {missing}'
