"""Copies the latest benchmark tables (benchmarks/results/<name>.md) into README.md,
between the `<!-- bench:<name> -->` and `<!-- /bench:<name> -->` markers."""

import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    readme_path = os.path.join(ROOT, "README.md")
    text = open(readme_path).read()
    for name in re.findall(r"<!-- bench:([\w]+) -->", text):
        table_path = os.path.join(ROOT, "benchmarks", "results", f"{name}.md")
        if not os.path.exists(table_path):
            print(f"no {table_path}: left as it is")
            continue
        table = open(table_path).read().strip()
        # the block may be empty: the closing marker then follows the opening one directly
        text = re.sub(rf"(<!-- bench:{name} -->\n)(?:.*?\n)?(<!-- /bench:{name} -->)",
                      lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
        print(f"README.md: {name} table updated")
    open(readme_path, "w").write(text)


if __name__ == "__main__":
    main()
