"""Training prompts built offline: templated math word problems, Python function tasks from the
standard library's docstrings and signatures, and templated writing/explanation requests.

All three are deterministic for a seed, need no network and carry no third-party text except the
Python standard library's docstrings (PSF licence). They widen the prompt mix that
``dflash data regenerate`` lets the target answer (``../shared/reference/training-prompts.md``).

    math_prompts(5000, seed=0)   # "Mia buys 7 notebooks at $3 each ... ?" + the benchmark suffix
    code_prompts(seed=0)         # HumanEval- and MBPP-style tasks for stdlib functions
    writing_prompts(2000, seed=0)
"""

from __future__ import annotations

import importlib
import inspect
import random

from dflash.data.datasets import HUMANEVAL_TEMPLATE, MATH_SUFFIX

NAMES = ("Mia", "Liam", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Sofia", "Kenji", "Amara",
         "Lucas", "Priya", "Diego", "Hana", "Ethan", "Chloe", "Malik", "Ines", "Tom")  # fmt: skip
ITEMS = (("notebook", "notebooks"), ("apple", "apples"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("cupcake", "cupcakes"), ("book", "books"), ("plant", "plants"), ("toy car", "toy cars"),
         ("bag of rice", "bags of rice"), ("sticker", "stickers"), ("shirt", "shirts"))  # fmt: skip


def _money(x: float) -> str:
    return f"${x:,.2f}".replace(".00", "")


def _math_one(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    one, many = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 25), rng.randint(2, 12)
    price = rng.choice([0.5, 1.25, 2, 3, 4.5, 5, 7, 12, 15])
    kind = rng.randrange(14)
    if kind == 0:
        return (f"{n1} buys {a} {many} at {_money(price)} each and pays with a "
                f"{_money(100 if a * price < 100 else 500)} bill. How much change does {n1} get?")  # fmt: skip
    if kind == 1:
        return (f"{n1} has {a + b} {many}. {n1} gives {b} to {n2} and then buys {c} more. "
                f"How many {many} does {n1} have now?")  # fmt: skip
    if kind == 2:
        speed, hours = rng.randint(30, 90), rng.randint(2, 9)
        return (f"A train travels at {speed} miles per hour for {hours} hours, then at "
                f"{speed + rng.randint(5, 20)} miles per hour for {c} more hours. How far does it "
                "travel in total?")  # fmt: skip
    if kind == 3:
        return (f"{n1} is {a} years old. {n2} is {c} years older than twice {n1}'s age. How old "
                f"will {n2} be in {b} years?")  # fmt: skip
    if kind == 4:
        pct = rng.choice([10, 15, 20, 25, 30, 40, 50])
        return (f"A jacket costs {_money(a * 5)}. It is on sale for {pct}% off, and then a "
                f"{rng.choice([5, 8, 10])}% sales tax is added. What is the final price?")  # fmt: skip
    if kind == 5:
        return (f"A class has {a + b} students. {rng.choice([1, 2, 3])}/"
                f"{rng.choice([4, 5, 6])} of them walk to school and the rest take the bus. How "
                "many students take the bus? Round to the nearest whole number if needed.")  # fmt: skip
    if kind == 6:
        x = rng.randint(-12, 12)
        k, m = rng.randint(2, 9), rng.randint(-20, 20)
        return f"Solve for x: {k}x {'+' if m >= 0 else '-'} {abs(m)} = {k * x + m}."
    if kind == 7:
        w, h = rng.randint(3, 30), rng.randint(3, 30)
        return (f"A rectangular garden is {w} meters long and {h} meters wide. A path 1 meter wide "
                "runs around the outside of the garden. What is the area of the path?")  # fmt: skip
    if kind == 8:
        return (f"{n1} reads {a} pages on Monday and {b} pages more each day than the day before. "
                f"How many pages has {n1} read after {c % 6 + 2} days?")  # fmt: skip
    if kind == 9:
        x, y = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["the sum of the squares", "the product", "the least common multiple",
                         "the greatest common divisor"])  # fmt: skip
        return f"What is {op} of {x} and {y}?"
    if kind == 10:
        n = rng.randint(3, 8)
        return (f"How many ways can {n} different books be arranged on a shelf if two particular "
                "books must be next to each other?")  # fmt: skip
    if kind == 11:
        r = rng.randint(2, 15)
        return f"What is the area of a circle whose circumference is {2 * r}π? Express it in terms of π."
    if kind == 12:
        return (f"{n1} earns {_money(price * 10)} per hour and works {a % 9 + 2} hours a day for "
                f"{c % 5 + 3} days. {n1} spends a quarter of it on food. How much is left?")  # fmt: skip
    p, q = rng.randint(2, 9), rng.randint(2, 9)
    return f"If f(x) = {p}x^2 - {q}x + {c}, what is f({rng.randint(-5, 6)})?"


def math_prompts(n: int, seed: int = 0, suffix_share: float = 0.8) -> list[str]:
    """``n`` distinct templated math problems; most end with the benchmarks' step-by-step/boxed
    suffix (``MATH_SUFFIX``), the rest are bare questions."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        q = _math_one(rng)
        if q in seen:
            continue
        seen.add(q)
        out.append(q + MATH_SUFFIX if rng.random() < suffix_share else q)
    return out


STDLIB_MODULES = (
    "string", "textwrap", "re", "difflib", "statistics", "math", "fractions", "decimal", "random",
    "itertools", "functools", "operator", "collections", "heapq", "bisect", "copy", "json", "csv",
    "base64", "binascii", "hashlib", "datetime", "calendar", "os.path", "posixpath", "fnmatch",
    "glob", "shlex", "html", "urllib.parse", "ipaddress", "colorsys", "zlib", "gzip", "struct",
    "codecs", "unicodedata", "pprint", "reprlib", "enum", "numbers", "cmath", "secrets", "uuid",
    "email.utils", "mimetypes", "locale", "gettext", "keyword", "tokenize", "ast", "dis", "inspect",
    "textwrap", "shutil", "tempfile", "pathlib", "configparser", "argparse", "logging", "queue",
    "sched", "graphlib", "zipfile", "tarfile", "quopri", "netrc", "plistlib", "wave", "filecmp",
)  # fmt: skip


def _stdlib_functions() -> list[tuple[str, str, str, str]]:
    """(module, name, signature, first docstring paragraph) of documented stdlib functions."""
    found, seen = [], set()
    for mod_name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - a module missing on this Python is simply skipped
            continue
        members = []
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_"):
                continue
            if inspect.isfunction(obj) or inspect.isbuiltin(obj):
                members.append((name, obj))
            elif inspect.isclass(obj) and getattr(obj, "__module__", "") == mod.__name__:
                for mname, meth in sorted(vars(obj).items()):
                    if not mname.startswith("_") and inspect.isfunction(meth):
                        members.append((f"{name}.{mname}", meth))
        for name, obj in members:
            doc = inspect.getdoc(obj) or ""
            para = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if len(para) < 25 or len(para) > 400 or para.startswith(("Return self", "See ")):
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            if len(sig) > 120:
                continue
            key = (name.split(".")[-1], para)
            if key in seen:
                continue
            seen.add(key)
            found.append((mod_name, name, sig, para))
    return found


def code_prompts(seed: int = 0) -> list[str]:
    """Python tasks from stdlib functions, two styles each: a HumanEval-like stub with the
    docstring, and an MBPP-like one-line request ("Write a Python function ...")."""
    rng = random.Random(seed)
    out = []
    for mod, name, sig, para in _stdlib_functions():
        fname = name.split(".")[-1]
        sig = sig.replace("(self, ", "(").replace("(self)", "()")
        stub = f'def {fname}{sig}:\n    """{para}\n    """\n'
        out.append(HUMANEVAL_TEMPLATE.format(prompt=stub))
        verb = rng.choice(["Write a Python function", "Implement a Python function",
                           "Write a function in Python", "Create a Python function"])  # fmt: skip
        first = para[0].lower() + para[1:]
        out.append(f"{verb} `{fname}{sig}` (like `{mod}.{name}` in the standard library, without "
                   f"using it) that does the following: {first}")  # fmt: skip
    rng.shuffle(out)
    return out


TOPICS = ("photosynthesis", "the French Revolution", "compound interest", "black holes",
          "machine learning", "the water cycle", "vaccines", "climate change", "the stock market",
          "volcanoes", "the Roman Empire", "recycling", "sleep", "meditation", "electric cars",
          "the internet", "DNA", "inflation", "the Moon landing", "coral reefs", "bees",
          "public libraries", "remote work", "chess", "jazz", "the printing press", "gravity",
          "renewable energy", "time management", "learning a new language", "urban gardening",
          "the human heart", "earthquakes", "blockchain", "the Olympic Games", "antibiotics",
          "rainforests", "cybersecurity", "the Silk Road", "prime numbers", "supply and demand",
          "sorting algorithms", "recursion", "databases", "the immune system", "plate tectonics")  # fmt: skip
TASKS = ("Explain {t} to a ten-year-old.", "Write a short blog post about {t}.",
         "Give me five interesting facts about {t}.", "Write a haiku about {t}.",
         "What are the pros and cons of {t}?", "Summarize the history of {t} in one paragraph.",
         "Write a persuasive paragraph arguing that everyone should learn about {t}.",
         "Create a short quiz with three questions about {t}, with answers.",
         "Describe {t} in the style of a news report.", "Write a short story that involves {t}.",
         "Compare {t} and {u} in a few sentences.", "Write an email to a friend recommending a book about {t}.",
         "List the key terms someone should know about {t}, with one-line definitions.",
         "Draft a two-day lesson plan that teaches {t}.",
         "Write a dialogue between a teacher and a student about {t}.",
         "What are common misconceptions about {t}?", "Write a limerick about {t}.",
         "Outline a presentation about {t} with five slides.")  # fmt: skip


def writing_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct templated writing/explanation requests (MT-Bench-like variety)."""
    rng = random.Random(seed)
    combos = [(task, t, u) for task in TASKS for t in TOPICS for u in TOPICS if u != t]
    rng.shuffle(combos)
    out, seen = [], set()
    for task, t, u in combos:
        text = task.format(t=t, u=u)
        if text not in seen:
            seen.add(text)
            out.append(text)
        if len(out) >= n:
            break
    return out
