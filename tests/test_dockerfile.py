"""The Dockerfile builds the image every file under cluster/ names (checked statically: nothing is built here):
its documented tag, the package's version, the Ray that pyproject pins and the RayClusters' rayVersion, a Python
that meets requires-python, a torch within pyproject's bound, and COPY lines that bring what `pip install` needs
(none of it dropped by .dockerignore)."""

import fnmatch
import re
import shlex

import ray
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from test_cluster_configs import DOCKERFILE, KUBERAY, PYPROJECT, ROOT, all_yaml, load


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of a Dockerfile, continuation lines joined, comment lines dropped."""
    instructions, current = [], ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (current + line).strip().partition(" ")
        instructions.append((word.upper(), rest.strip()))
        current = ""
    return instructions


def images_named(node) -> set[str]:
    """Every image a cluster YAML names (Kubernetes containers' `image`, the launcher's docker `image`)."""
    if isinstance(node, dict):
        return {v for k, v in node.items() if k in ("image", "head_image", "worker_image") and isinstance(v, str)} \
            | {image for v in node.values() for image in images_named(v)}
    if isinstance(node, list):
        return {image for v in node for image in images_named(v)}
    return set()


def test_dockerfile_builds_the_image_the_manifests_name():
    assert DOCKERFILE.is_file(), "no Dockerfile at the repository root: nothing builds the image the manifests name"
    text = DOCKERFILE.read_text()
    comments = [line.lstrip("# ") for line in text.splitlines() if line.startswith("#")]
    builds = [shlex.split(line) for line in comments if line.startswith("docker build")]
    assert len(builds) == 1, "the Dockerfile's comments give no (or several) `docker build -t IMAGE .`"
    image, context = builds[0][builds[0].index("-t") + 1], builds[0][-1]
    assert context == ".", f"`docker build` context {context!r}: the Dockerfile copies from the repository root"
    assert f"docker push {image}" in comments, f"the Dockerfile's comments do not say to push {image}"
    named = {image for path in all_yaml() for doc in load(path) for image in images_named(doc)}
    assert named == {image}, f"cluster/ names images {sorted(named)}, the Dockerfile builds {image}"
    tag = image.rsplit(":", 1)[1]
    assert tag.split("-")[0] == PYPROJECT["version"] and tag.endswith("-gpu"), \
        f"image tag {tag!r}: not <the package's version {PYPROJECT['version']}>-gpu"

    instructions = dockerfile_instructions(text)
    deps = {Requirement(d).name: Requirement(d) for d in PYPROJECT["dependencies"]}
    base, = [args for word, args in instructions if word == "FROM"]
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", base)
    assert match, f"FROM {base}: not one of Ray's GPU images, rayproject/ray:<version>-py<XY>-gpu"
    ray_version, python = match.group(1), f"{match.group(2)}.{match.group(3)}"
    assert ray_version == ray.__version__ and deps["ray"].specifier.contains(ray_version), \
        f"the image's Ray {ray_version}: these checks ran Ray {ray.__version__}, pyproject.toml pins {deps['ray']}"
    for path in KUBERAY:
        cluster = next(doc for doc in load(path) if doc["kind"] == "RayCluster")
        assert cluster["spec"]["rayVersion"] == ray_version, f"{path.name}: rayVersion is not the image's Ray"
    assert SpecifierSet(PYPROJECT["requires-python"]).contains(python), f"the image's Python {python}"

    args = dict(a.partition("=")[::2] for word, a in instructions if word == "ARG")
    torch = args.get("TORCH_VERSION", "")
    assert deps["torch"].specifier.contains(torch), f"torch {torch!r} outside pyproject.toml's {deps['torch']}"
    runs = [a for word, a in instructions if word == "RUN"]
    assert any('"torch==${TORCH_VERSION}"' in run for run in runs), "no RUN installs torch==${TORCH_VERSION}"

    # What `pip install` of the package needs is copied, from files that exist and .dockerignore does not drop.
    copied: dict[str, str] = {}
    for word, a in instructions:
        if word == "COPY":
            *sources, destination = [w for w in shlex.split(a) if not w.startswith("--")]
            copied.update({source: destination for source in sources})
    needed = {"pyproject.toml", PYPROJECT["readme"], "ray_diloco"}
    assert needed <= copied.keys(), f"the Dockerfile copies {sorted(copied)}, not {sorted(needed)}"
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        dropped_by = [pattern for pattern in ignored if fnmatch.fnmatch(source, pattern)]
        assert not dropped_by, f"COPY {source}: .dockerignore drops it ({dropped_by})"
    package_dir = copied["pyproject.toml"].rstrip("/")
    commands = [shlex.split(command) for run in runs for command in re.split(r"&&|;", run)]
    assert any(words[:2] == ["pip", "install"] and package_dir in [w.rstrip("/") for w in words[2:]]
               for words in commands), f"no RUN pip-installs the package copied to {package_dir}"
