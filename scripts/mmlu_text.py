"""Write a fixed text for `braid eval-perplexity` and `llama-perplexity` from MMLU's data:
every subject's header and solved dev questions, in subject order (no download, and the same
bytes wherever the data is).

    python scripts/mmlu_text.py ../shared/data/mmlu mmlu_dev.txt
"""

import argparse
from pathlib import Path

from braid.eval.mmlu import dev_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", help="MMLU folder with dev/ and test/ CSV files")
    parser.add_argument("out", help="the text file to write")
    args = parser.parse_args()
    text = dev_text(args.data_dir)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(text)} characters")


if __name__ == "__main__":
    main()
