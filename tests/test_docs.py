"""The documentation site builds from a clean tree with warnings as errors (what `make docs`
runs), so a docstring or page that breaks it fails CI."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).parents[1] / "docs"


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    """The site built as `make docs` builds it; its folder."""
    out = tmp_path_factory.mktemp("docs") / "html"
    run = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
         str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-5000:]
    return out


def test_docs_build_without_warnings(html):
    for page in ("index", "quickstart", "modes", "determinism", "plans", "moe", "loss",
                 "switching", "distributed", "enable",
                 "comparison", "api"):
        assert (html / f"{page}.html").exists(), page
    api = (html / "api.html").read_text()
    for name in ("detsum.segment_sum", "detsum.index_add_", "detsum.scatter_reduce",
                 "detsum.moe.unpermute", "detsum.loss.batch_grad", "detsum.explain",
                 "detsum.RunningSum", "detsum.hf.use_detsum_experts",
                 "detsum.distributed.all_reduce_"):
        assert f'id="{name}"' in api, name


def test_docs_read_offline(html):
    """Math was left to MathJax from a CDN, so a page opened offline showed raw TeX: it is
    drawn at build time into the page, and no page loads anything from the network."""
    pages = {page.name: page.read_text() for page in html.glob("*.html")}
    for name, text in pages.items():
        assert "mathjax" not in text.lower(), name
        assert not re.search(r'<script[^>]+src="(https?:)?//', text), name
    api = pages["api.html"]
    formula = r"\mathrm{out}_s = \sum_{p=\mathrm{offsets}[s]}"
    drawn = re.findall(r'<img class="math[^"]*" src="data:image/svg\+xml;base64,[^"]+" '
                       r'alt="([^"]*)"', api)
    assert any(alt.startswith(formula) for alt in drawn), drawn
    assert len(drawn) >= 5, drawn
    # Long code lines wrap instead of hiding behind a scrollbar.
    assert "pre-wrap" in (html / "_static" / "custom.css").read_text()


def test_quickstart_code_runs():
    """The quick start's Python block is the newcomer's first custom Function: it must run and
    its assertion (autograd's bits, in bf16) must hold."""
    text = (DOCS / "quickstart.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "no python block in quickstart.md"
    for block in blocks:
        exec(compile(block, "quickstart.md", "exec"), {"__name__": "quickstart"})


def test_enable_page_code_runs():
    """The switch page's blocks run, their assertions hold, and they leave the switch off."""
    import detsum.switch

    text = (DOCS / "enable.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, "enable.md", "exec"), {"__name__": "enable"})
    assert detsum.switch.current_mode() is None


def test_plans_page_code_runs():
    """The plans page's blocks run: the first as it is, the custom Function's backward against
    autograd's own gradient of x[index], bit for bit."""
    text = (DOCS / "plans.md").read_text()
    blocks = [re.sub(r"^  ", "", block, flags=re.M)
              for block in re.findall(r"```python\n(.*?)```", text, flags=re.S)]
    assert len(blocks) == 2
    namespace = {"__name__": "plans"}
    for block in blocks:
        exec(compile(block, "plans.md", "exec"), namespace)
    import torch

    x = torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True)
    index = torch.tensor([3, 0, 3, 3, 1])
    grad = torch.randn(5, 3, dtype=torch.bfloat16)
    (ours,) = torch.autograd.grad(namespace["Gather"].apply(x, index), x, grad)
    (autograds,) = torch.autograd.grad(x[index], x, grad)
    assert torch.equal(ours, autograds)


def test_pages_name_only_files_of_the_project():
    """The contract once cited SPEC.md, a draft outside the repository: every .md file a page
    or the README names must be one of the project's own."""
    root = DOCS.parent
    for page in [root / "README.md", *DOCS.glob("*.md")]:
        for name in re.findall(r"[\w./-]+\.md\b", page.read_text()):
            if name.startswith(("http", "//")) or "://" in name:
                continue
            candidates = [page.parent / name, root / name, DOCS / name,
                          root / "benches" / name]
            assert any(c.exists() for c in candidates), f"{page.name} names {name}"


def test_the_tests_map_names_every_module():
    """tests/README.md, a newcomer's map from each module to its tests, names every module of
    the package (``detsum/``, ``kernels/``) and every module of the tests."""
    root = DOCS.parent
    named = set(re.findall(r"`([\w./]+\.py)`", (root / "tests" / "README.md").read_text()))
    modules = [path.relative_to(root).as_posix() for folder in ("detsum", "kernels")
               for path in (root / folder).rglob("*.py")]
    missing = [module for module in modules if module not in named]
    missing += [path.name for path in (root / "tests").glob("*.py") if path.name not in named]
    assert not missing, f"tests/README.md does not name {sorted(missing)}"


def test_switching_page_says_the_torch_scatter_api_is_not_scriptable():
    """docs/switching.md says every function of detsum's torch_scatter API is refused by
    torch.jit.script (torch_scatter's own suite scripts each one): if that changes, so must
    the page."""
    import warnings

    import torch

    import detsum.scatter_compat

    # Refused either way: a construct TorchScript does not parse (NotSupportedError), or a
    # compile error (RuntimeError: detsum.Mode's value); which comes first depends on what the
    # process compiled before.
    refused = (torch.jit.frontend.NotSupportedError, RuntimeError)
    for name in detsum.scatter_compat.__all__:
        with warnings.catch_warnings(), pytest.raises(refused):
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.script(getattr(detsum.scatter_compat, name))


def test_readme_quick_subset_selects_each_part_it_names():
    """The README's quick subset is a -k filter over test names: a renamed test would drop out
    of it silently. Each part the README says it runs must still be selected."""
    readme = (DOCS.parent / "README.md").read_text()
    (command,) = [line for line in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
                  if "-k " in line and "numba_matches_reference" in line]
    args = command.split(" -m pytest ", 1)[1]
    paths, expression = args.split(" -k ")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *paths.split(), "-k", expression.strip().strip('"'),
         "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=DOCS.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    selected = [line for line in run.stdout.splitlines() if "::" in line]
    dtypes = {"segment_sum": ("float64", "float32", "float16", "bfloat16"),
              "index_add": ("float64", "float32", "float16", "bfloat16"),
              "scatter_reduce": ("float32", "bfloat16")}
    for primitive, its_dtypes in dtypes.items():
        for mode in ("autograd", "fp32", "kahan", "exact"):
            for dtype in its_dtypes:
                assert any(f"test_{primitive}.py::test_numba_matches_reference[" in line
                           and f"{mode}-{dtype}-" in line for line in selected), \
                    (primitive, mode, dtype)
    for reduction in ("sum", "mean", "prod", "amax", "amin"):
        assert any(f"test_scatter_reduce.py::test_numba_matches_reference[{reduction}-" in line
                   for line in selected), reduction
    assert any(line.startswith("tests/test_validation.py::") for line in selected)
    assert any(line.startswith("tests/test_docs.py::") for line in selected)
    assert any(line.startswith("detsum/") for line in selected)
