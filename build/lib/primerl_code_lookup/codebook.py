"""The `primerl-code-lookup` tool server: `lookup(word)` answers the word's 3-digit code.

A code is a keyed hash of the word (`salt`), so no model can know it without asking: the tool is necessary. The
server is taskset-scoped (one process for a whole run, started by verifiers as `python -m primerl_code_lookup.codebook`).
"""

import hashlib
import re

import verifiers.v1 as vf

WORD = re.compile(r"[a-z]{1,16}")


def code_of(word: str, salt: str) -> str:
    return f"{int.from_bytes(hashlib.sha256(f'{salt}/{word}'.encode()).digest()[:8], 'big') % 1000:03d}"


class CodeBookConfig(vf.SharedToolsetConfig):
    salt: str = "primerl"


class CodeBook(vf.Toolset[CodeBookConfig]):
    TOOL_PREFIX = None  # the model calls `lookup`, not `code_book_lookup`

    @vf.tool
    async def lookup(self, word: str) -> str:
        """Look up a word's code."""
        if not WORD.fullmatch(word):
            raise ValueError(f"no code for {word!r}: words are 1-16 lowercase letters")
        return code_of(word, self.config.salt)


if __name__ == "__main__":
    CodeBook.run()
