"""Read benchmarks/device/stack.txt: `python benchmarks/device/stack.py SECTION` prints that section's lines
(`python`, `installed`, `carried`) without comments, one requirement a line, for pip and the scripts."""
import os
import sys

STACK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stack.txt")


def section(name: str, path: str = STACK) -> list[str]:
    """The lines of `[name]`, comments and blanks dropped."""
    lines, current = [], None
    with open(path) as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if line.startswith("[") and line.endswith("]"):
                current = line[1:-1]
            elif line and current == name:
                lines.append(line)
    if not lines:
        raise SystemExit(f"error: {path} has no section [{name}]")
    return lines


def pins(name: str, path: str = STACK) -> dict[str, str]:
    """{distribution name, lower-case with '-': version} of a section's `name==version` lines."""
    return {req.split("==")[0].lower().replace("_", "-"): req.split("==")[1] for req in section(name, path)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/device/stack.py python|installed|carried")
    print("\n".join(section(sys.argv[1])))
