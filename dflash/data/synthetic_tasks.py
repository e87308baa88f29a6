"""More training prompts built offline: templated programming tasks (MBPP- and HumanEval-style)
and chat requests of the MT-Bench categories the writing templates miss (roleplay, extraction,
reasoning, STEM/humanities questions, a request with a follow-up), and compositions (emails,
posts, stories, speeches, plans) with a tone or length constraint.

Deterministic for a seed, no network, no third-party text. They widen the code and chat share of
the prompt mix (``scripts/build_train_prompts.py``): the demo draft's τ on humaneval, mbpp and
mt-bench lags gsm8k because those kinds were 5% and 8% of its prompts.

    task_prompts(6000, seed=0)   # "Write a Python function to return the second largest ..."
    chat_prompts(4000, seed=0)   # "Pretend you are a tour guide in Kyoto. ..."
    compose_prompts(6000, seed=0)  # "Draft a friendly email about a trip to Lisbon. ..."
"""

from __future__ import annotations

import random

from dflash.data.datasets import HUMANEVAL_TEMPLATE

# (function name, arguments, what it does) — basic list/string/number/dict tasks
TASKS = (
    ("second_largest", "nums", "return the second largest distinct number in a list of integers, or None if there is none"),
    ("is_palindrome", "s", "check whether a string is a palindrome, ignoring case, spaces and punctuation"),
    ("count_vowels", "s", "count the vowels in a string"),
    ("reverse_words", "sentence", "reverse the order of the words in a sentence"),
    ("flatten", "nested", "flatten an arbitrarily nested list of lists into a single list"),
    ("char_frequency", "s", "return a dictionary mapping each character of a string to the number of times it occurs"),
    ("is_prime", "n", "check whether an integer is a prime number"),
    ("primes_below", "n", "return all prime numbers smaller than n using the sieve of Eratosthenes"),
    ("fibonacci", "n", "return the n-th Fibonacci number"),
    ("factorial", "n", "compute the factorial of a non-negative integer"),
    ("gcd", "a, b", "return the greatest common divisor of two integers"),
    ("lcm", "a, b", "return the least common multiple of two positive integers"),
    ("digit_sum", "n", "return the sum of the digits of a non-negative integer"),
    ("binary_to_decimal", "bits", "convert a binary string such as '1011' to an integer"),
    ("decimal_to_binary", "n", "convert a non-negative integer to its binary representation as a string"),
    ("remove_duplicates", "items", "remove duplicates from a list while keeping the first occurrence order"),
    ("merge_sorted", "a, b", "merge two sorted lists into one sorted list"),
    ("binary_search", "arr, target", "return the index of target in a sorted list, or -1 if it is absent"),
    ("rotate_list", "items, k", "rotate a list to the right by k positions"),
    ("chunk", "items, size", "split a list into consecutive chunks of the given size"),
    ("max_subarray_sum", "nums", "return the largest sum of a contiguous non-empty sub-list"),
    ("longest_common_prefix", "words", "return the longest common prefix of a list of strings"),
    ("is_anagram", "a, b", "check whether two strings are anagrams of each other"),
    ("group_anagrams", "words", "group a list of words into lists of anagrams"),
    ("word_count", "text", "count how many times each word occurs in a text, ignoring case"),
    ("capitalize_words", "s", "capitalize the first letter of every word in a string"),
    ("run_length_encode", "s", "compress a string with run-length encoding, e.g. 'aaabcc' -> 'a3b1c2'"),
    ("run_length_decode", "s", "decode a run-length encoded string such as 'a3b1c2'"),
    ("valid_parentheses", "s", "check whether the brackets (), [] and {} in a string are balanced"),
    ("two_sum", "nums, target", "return the indices of the two numbers that add up to target"),
    ("matrix_transpose", "matrix", "transpose a matrix given as a list of rows"),
    ("matrix_multiply", "a, b", "multiply two matrices given as lists of rows"),
    ("is_leap_year", "year", "check whether a year is a leap year in the Gregorian calendar"),
    ("celsius_to_fahrenheit", "c", "convert a temperature from Celsius to Fahrenheit"),
    ("median", "nums", "return the median of a non-empty list of numbers"),
    ("mode", "nums", "return the most frequent element of a list (the smallest one on a tie)"),
    ("cumulative_sum", "nums", "return the list of running totals of a list of numbers"),
    ("pairwise_differences", "nums", "return the differences between consecutive elements of a list"),
    ("snake_to_camel", "name", "convert a snake_case identifier to camelCase"),
    ("camel_to_snake", "name", "convert a camelCase identifier to snake_case"),
    ("count_words_longer_than", "text, n", "count the words in a text that are longer than n characters"),
    ("find_missing_number", "nums", "find the missing number in a list containing 0..n with one number missing"),
    ("intersection", "a, b", "return the sorted list of elements common to two lists"),
    ("symmetric_difference", "a, b", "return the elements that are in exactly one of two lists"),
    ("nth_largest", "nums, n", "return the n-th largest element of a list using a heap"),
    ("is_armstrong", "n", "check whether a number equals the sum of its digits each raised to the number of digits"),
    ("perfect_squares", "n", "return all perfect squares less than or equal to n"),
    ("roman_to_int", "s", "convert a Roman numeral to an integer"),
    ("int_to_roman", "n", "convert an integer between 1 and 3999 to a Roman numeral"),
    ("caesar_cipher", "text, shift", "encrypt a text with a Caesar cipher of the given shift, keeping non-letters"),
    ("count_islands", "grid", "count the groups of connected 1s (up, down, left, right) in a grid of 0s and 1s"),
    ("dict_invert", "d", "invert a dictionary, mapping each value to the list of keys that had it"),
    ("sort_by_value", "d", "return the keys of a dictionary sorted by their values in descending order"),
    ("deep_merge", "a, b", "merge two nested dictionaries, the values of b winning on conflicts"),
    ("top_k_words", "text, k", "return the k most common words of a text with their counts"),
    ("validate_email", "address", "check with a regular expression whether a string looks like an email address"),
    ("extract_numbers", "text", "extract all integers and decimal numbers from a text"),
    ("pascal_triangle", "n", "return the first n rows of Pascal's triangle"),
    ("power_set", "items", "return all subsets of a list"),
    ("permutations", "items", "return all permutations of a list without using itertools"),
    ("staircase_ways", "n", "count the ways to climb n stairs taking 1 or 2 steps at a time"),
    ("coin_change", "coins, amount", "return the fewest coins that make up an amount, or -1 if impossible"),
    ("edit_distance", "a, b", "compute the Levenshtein distance between two strings"),
    ("longest_increasing_subsequence", "nums", "return the length of the longest strictly increasing subsequence"),
    ("knapsack", "weights, values, capacity", "solve the 0/1 knapsack problem and return the best total value"),
    ("bubble_sort", "nums", "sort a list with bubble sort and return it"),
    ("insertion_sort", "nums", "sort a list with insertion sort and return it"),
    ("quick_sort", "nums", "sort a list with quicksort and return a new list"),
    ("merge_sort", "nums", "sort a list with merge sort and return a new list"),
    ("average_grade", "grades", "return the average of a dictionary of student names to lists of grades, per student"),
    ("spiral_order", "matrix", "return the elements of a matrix in spiral order"),
    ("is_sorted", "items", "check whether a list is sorted in non-decreasing order"),
    ("zip_to_dict", "keys, values", "build a dictionary from a list of keys and a list of values"),
    ("string_compression_ratio", "s", "return the ratio between the zlib-compressed and the original length of a string"),
    ("hex_to_rgb", "color", "convert a hex color such as '#ff8800' to an (r, g, b) tuple"),
    ("seconds_to_hms", "seconds", "convert a number of seconds to a string 'HH:MM:SS'"),
    ("days_between", "d1, d2", "return the number of days between two dates given as 'YYYY-MM-DD' strings"),
    ("parse_csv_line", "line", "split a CSV line into fields, honouring double-quoted fields that contain commas"),
    ("moving_average", "nums, window", "return the moving averages of a list for the given window size"),
    ("clamp", "x, low, high", "clamp a number into the range [low, high]"),
    ("is_power_of_two", "n", "check whether a positive integer is a power of two"),
    ("count_bits", "n", "count the 1 bits in the binary representation of a non-negative integer"),
    ("last_word_length", "s", "return the length of the last word in a string"),
    ("first_unique_char", "s", "return the index of the first non-repeating character in a string, or -1"),
    ("kth_smallest_in_matrix", "matrix, k", "return the k-th smallest element of a row- and column-sorted matrix"),
    ("triangle_type", "a, b, c", "classify a triangle by its side lengths as equilateral, isosceles, scalene or invalid"),
    ("compound_interest", "principal, rate, years", "return the balance after yearly compounding at the given rate"),
    ("bmi_category", "weight_kg, height_m", "compute the body mass index and return its category"),
    ("wrap_text", "text, width", "wrap a text into lines of at most width characters without breaking words"),
    ("dedupe_preserve_case", "words", "remove case-insensitive duplicate words, keeping the first spelling"),
    ("stack_min", "operations", "simulate a stack that supports push, pop and get_min in O(1) and return the get_min results"),
    ("queue_with_two_stacks", "operations", "implement a queue with two stacks and return the dequeued values"),
    ("lru_cache_sim", "capacity, operations", "simulate an LRU cache and return the results of the get operations"),
    ("tree_height", "tree", "return the height of a binary tree given as nested tuples (value, left, right)"),
    ("bfs_shortest_path", "graph, start, goal", "return the shortest path between two nodes of an unweighted graph given as an adjacency dict"),
    ("has_cycle", "graph", "check whether a directed graph given as an adjacency dict has a cycle"),
    ("topological_sort", "graph", "return a topological order of a directed acyclic graph given as an adjacency dict"),
    ("dijkstra", "graph, source", "return the shortest distances from a source in a weighted graph given as an adjacency dict"),
)  # fmt: skip

MBPP_VERBS = ("Write a function to", "Write a python function to", "Write a Python function that will",
              "Create a function to", "Implement a function to", "Write a program to")  # fmt: skip
EXTRAS = ("", "", " Include a docstring.", " Add type hints.", " Explain how it works after the code.",
          " Then show two example calls and their output.", " Make it run in linear time.",
          " Do not use any imports.", " Handle empty input gracefully.")  # fmt: skip


def _distinct(n: int, rng: random.Random, one) -> list[str]:
    """Up to ``n`` distinct texts drawn with ``one(rng)``, in draw order; stops early once 5,000
    draws in a row were duplicates (the templates' supply is used up)."""
    out, seen, misses = [], set(), 0
    while len(out) < n and misses < 5000:
        text = one(rng)
        misses = misses + 1 if text in seen else 0
        if not misses:
            seen.add(text)
            out.append(text)
    return out


def _task_one(rng: random.Random) -> str:
    name, args, what = rng.choice(TASKS)
    style = rng.randrange(4)
    if style == 0:
        stub = f'def {name}({args}):\n    """{what[0].upper() + what[1:]}.\n    """\n'
        return HUMANEVAL_TEMPLATE.format(prompt=stub)
    if style == 1:
        return f"{rng.choice(MBPP_VERBS)} {what}. Name it `{name}`."
    return f"{rng.choice(MBPP_VERBS)} {what}.{rng.choice(EXTRAS)}"


def task_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to ``n`` distinct programming tasks (about 5,000 exist), mixing an MBPP-style one-line
    request (sometimes naming the function) and a HumanEval-style stub in the benchmark template."""
    return _distinct(n, random.Random(seed), _task_one)

PLACES = ("Kyoto", "Lisbon", "a Mars colony", "a medieval castle", "a busy hospital", "a small bakery",
          "an airport", "a space station", "the Amazon rainforest", "a high school", "a startup office",
          "a museum of natural history", "a farm", "a submarine", "a public library")  # fmt: skip
ROLES = ("a tour guide", "a detective", "a chef", "a personal trainer", "a history teacher",
         "a customer support agent", "a travel agent", "a pirate captain", "a doctor", "a poet",
         "a software architect", "a job interviewer", "a financial advisor", "a museum curator",
         "a sports commentator", "Sherlock Holmes", "a medieval knight", "a stand-up comedian")  # fmt: skip
ROLEPLAY = ("Pretend you are {r} in {p}. Greet me and tell me what I should see first.",
            "Act as {r}. I will ask you questions; answer in character. First question: what does a typical day look like for you?",
            "You are {r} working in {p}. Describe the biggest problem you faced this week and how you solved it.",
            "Imagine you are {r}. Write a short speech welcoming new visitors to {p}.",
            "Role-play as {r} and give me three pieces of advice for my first week in {p}.")  # fmt: skip
PEOPLE = ("Anna", "Ben", "Carlos", "Dana", "Elif", "Femi", "Grace", "Hiro", "Ivan", "Julia")
EXTRACT = ("Extract every person's name and age from the text below and return them as JSON.\n\n{doc}",
           "Summarize the following text in two sentences.\n\n{doc}",
           "Read the text below and answer: who is the oldest person, and how old are they?\n\n{doc}",
           "Turn the following text into a Markdown table with columns Name, Age, City.\n\n{doc}",
           "List the cities mentioned in the text below in alphabetical order.\n\n{doc}")  # fmt: skip
CITIES = ("Paris", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Austin", "Seoul", "Perth")
REASONING = ("If all {a} are {b} and some {b} are {c}, can we conclude that some {a} are {c}? Explain.",
             "{p1} is taller than {p2}, and {p2} is taller than {p3}. Who is the shortest? Explain your reasoning.",
             "There are {n} people in a room and everyone shakes hands with everyone else once. How many handshakes happen? Think step by step.",
             "A bat and a ball cost {x} dollars in total. The bat costs {y} dollars more than the ball. How much does the ball cost?",
             "{p1} has twice as many siblings as {p2}. Together they have {n} siblings. How many does each have?")  # fmt: skip
NOUNS = ("cats", "artists", "engineers", "birds", "students", "doctors", "musicians", "runners")
QUESTIONS = ("What causes {t}? Answer in a short paragraph.", "How would you explain {t} to a beginner? Use an analogy.",
             "What is the most important open question about {t}?", "Give a step-by-step explanation of how {t} works.",
             "Write three multiple-choice questions about {t} for a high-school test.")  # fmt: skip
SUBJECTS = ("the seasons", "tides", "rainbows", "inflation", "the Renaissance", "democracy", "evolution",
            "electricity", "photosynthesis", "the Cold War", "supply chains", "nuclear fusion",
            "the placebo effect", "the theory of relativity", "impressionist painting", "the Industrial Revolution")  # fmt: skip
FOLLOW = ("{q}\n\nNow rewrite your answer for a five-year-old.", "{q}\n\nAfterwards, list two sources a student could read next.",
          "{q}\n\nThen rewrite the answer as a short poem.", "{q}\n\nKeep the answer under 100 words, then give one follow-up question.")  # fmt: skip


def _doc(rng: random.Random) -> str:
    people = rng.sample(PEOPLE, rng.randint(2, 4))
    parts = [f"{p} is {rng.randint(19, 80)} years old and lives in {rng.choice(CITIES)}." for p in people]
    parts.insert(rng.randrange(len(parts) + 1), rng.choice(("They met at a conference last spring.",
                 "Most of them work in education.", "Two of them share a love of hiking.")))  # fmt: skip
    return " ".join(parts)


def _chat_one(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(ROLEPLAY).format(r=rng.choice(ROLES), p=rng.choice(PLACES))
    if kind == 1:
        return rng.choice(EXTRACT).format(doc=_doc(rng))
    if kind == 2:
        a, b, c = rng.sample(NOUNS, 3)
        p1, p2, p3 = rng.sample(PEOPLE, 3)
        x = rng.choice([1.10, 2.20, 3.30, 5.50])
        return rng.choice(REASONING).format(a=a, b=b, c=c, p1=p1, p2=p2, p3=p3, n=rng.randint(4, 30),
                                            x=f"{x:.2f}", y=f"{x - 0.1 * rng.randint(1, 9):.2f}")  # fmt: skip
    q = rng.choice(QUESTIONS).format(t=rng.choice(SUBJECTS))
    return q if kind == 3 else rng.choice(FOLLOW).format(q=q)


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to ``n`` distinct chat requests: roleplay, extraction from a short generated text,
    small reasoning puzzles, STEM/humanities questions, and questions with a follow-up request."""
    return _distinct(n, random.Random(seed), _chat_one)

# Compositions (MT-Bench "writing" and "roleplay" kinds: emails, posts, stories, speeches, plans).
FORMS = ("a professional email", "a friendly email", "a short blog post", "a travel blog post",
         "a persuasive essay", "a short story", "a product description", "a speech",
         "a LinkedIn post", "a tweet thread of four tweets", "a restaurant review", "a cover letter",
         "a limerick", "a sonnet", "a dialogue between two friends", "a newsletter introduction",
         "a one-day itinerary", "a five-step plan", "a letter of complaint", "a thank-you note",
         "an advertisement", "a podcast intro script", "a short news article", "a FAQ with four questions")  # fmt: skip
ABOUT = ("a trip to {p}", "the opening of a new {s} in town", "why {t} matters",
         "a delayed shipment of {o}", "a first day at a new job as {r}", "learning {h}",
         "a weekend festival in {c}", "a missed deadline on a {s} project", "the benefits of {h}",
         "a lost {o} that was found again", "moving from {c} to {c2}", "a charity run for {s}s",
         "the history of {t}", "a robot that wants to become {r}", "choosing between {o} and {o2}")  # fmt: skip
SPOTS = ("bakery", "library", "gym", "bookshop", "community garden", "coffee shop", "museum",
         "animal shelter", "co-working space", "music school", "bike repair shop", "school")  # fmt: skip
OBJECTS = ("laptops", "running shoes", "a camera", "an electric bike", "a smartwatch",
           "headphones", "a houseplant", "a violin", "office chairs", "a tent", "a drone")  # fmt: skip
HOBBIES = ("to cook", "to play the guitar", "to swim", "yoga", "photography", "gardening",
           "to code in Python", "chess", "to speak Spanish", "journaling", "rock climbing")  # fmt: skip
TONES = ("", "", "", " Keep it under 150 words.", " Use a humorous tone.", " Make it formal.",
         " Write it for teenagers.", " End with a question to the reader.", " Use bullet points.",
         " Include a catchy title.", " Use exactly three paragraphs.", " Avoid the letter z.")  # fmt: skip
COMPOSE = ("Write {f} about {a}.{x}", "Draft {f} about {a}.{x}", "Compose {f} about {a}.{x}",
           "Could you write {f} about {a}?{x}", "Help me write {f} about {a}.{x}",
           "I need {f} about {a}.{x} Please write it.")  # fmt: skip


def _compose_one(rng: random.Random) -> str:
    c, c2 = rng.sample(CITIES, 2)
    o, o2 = rng.sample(OBJECTS, 2)
    about = rng.choice(ABOUT).format(p=rng.choice(PLACES), s=rng.choice(SPOTS), t=rng.choice(SUBJECTS),
                                     o=o, o2=o2, r=rng.choice(ROLES), h=rng.choice(HOBBIES), c=c, c2=c2)  # fmt: skip
    return rng.choice(COMPOSE).format(f=rng.choice(FORMS), a=about, x=rng.choice(TONES))


def compose_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to ``n`` distinct composition requests (emails, posts, stories, speeches, plans, poems)
    on templated topics, with an optional tone or length constraint."""
    return _distinct(n, random.Random(seed), _compose_one)
