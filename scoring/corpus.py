"""Procedural text to build prompts from: no downloads, seeded, varied.

Sentences come from templates over word lists in several genres (story, business report,
technical manual, source code, dialogue, recipe, log lines, legal text, letters), with names,
places, numbers and dates filled in at random. Everything takes a `random.Random`, so one seed
gives one text. The material only has to look like ordinary traffic and vary enough that a
miner cannot cache answers; it does not have to be good prose.
"""
from __future__ import annotations

import random

FIRST_NAMES = (
    "Amara", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kavya", "Lars",
    "Mei", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Viktor", "Wen", "Ximena",
    "Yusuf", "Zofia", "Aiko", "Bea", "Cyrus", "Dmitri", "Elif", "Femi", "Greta", "Hugo", "Ines", "Jonas",
    "Keiko", "Leila", "Mateo", "Nils", "Olga", "Pavel", "Rania", "Soren", "Tariq", "Ulla", "Vera", "Wiremu",
)
SURNAMES = (
    "Abara", "Bianchi", "Castillo", "Dubois", "Eriksen", "Fischer", "Gupta", "Haddad", "Ivanova", "Jensen",
    "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quispe", "Rahman", "Silva", "Tanaka",
    "Usman", "Varga", "Weber", "Xu", "Yilmaz", "Zhang", "Adeyemi", "Brennan", "Costa", "Duarte", "Engel",
    "Ferreira", "Horvat", "Iqbal", "Kaur", "Laine", "Mendes", "Novak", "Ortega", "Popescu", "Rossi", "Sato",
)
CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Tallinn", "Valparaiso", "Hanoi", "Tromso", "Cork", "Adelaide", "Quito",
    "Tbilisi", "Accra", "Ljubljana", "Montreal", "Porto", "Kraków", "Mendoza", "Busan", "Leipzig", "Gdansk",
)
PLACES = ("harbour", "market", "library", "station", "bakery", "workshop", "garden", "clinic", "museum",
          "warehouse", "ferry terminal", "courtyard", "observatory", "school", "bridge", "archive")
OBJECTS = ("lantern", "ledger", "bicycle", "compass", "notebook", "kettle", "telescope", "map", "violin",
           "umbrella", "radio", "key ring", "suitcase", "camera", "clock", "parcel")
ADJECTIVES = ("quiet", "crowded", "narrow", "bright", "old", "damp", "windy", "busy", "silent", "warm",
              "cold", "forgotten", "polished", "rusty", "tidy", "crooked")
WEATHER = ("rainy", "foggy", "sunny", "freezing", "humid", "stormy", "clear", "grey")
DAYTIME = ("morning", "afternoon", "evening", "night", "dawn", "noon")
ACTIONS = ("carried", "repaired", "found", "sold", "borrowed", "painted", "measured", "hid", "opened",
           "described", "photographed", "returned")
COMPANIES = ("Northwind Freight", "Halcyon Labs", "Bluefin Textiles", "Orchard Systems", "Kestrel Mining",
             "Lumen Energy", "Quarry & Sons", "Pioneer Biotech", "Saltmarsh Foods", "Vantage Rail")
METRICS = ("revenue", "operating margin", "headcount", "shipments", "customer churn", "capital spending",
           "net income", "order backlog", "energy use", "average delivery time")
TRENDS = ("rose", "fell", "held steady", "recovered", "slipped", "climbed", "doubled", "contracted")
COMPONENTS = ("valve", "relay", "sensor", "pump", "bearing", "controller", "fan", "filter", "gasket",
              "power supply", "firmware", "cooling loop", "shard", "scheduler", "cache")
TECH_VERBS = ("disconnect", "calibrate", "inspect", "replace", "restart", "flush", "tighten", "reset",
              "update", "drain", "label", "test")
PARAMETERS = ("pressure", "timeout", "voltage", "batch size", "flow rate", "threshold", "temperature",
              "buffer length", "sample rate", "retry limit")
UNITS = ("kPa", "ms", "V", "items", "L/min", "%", "°C", "KiB", "Hz", "tries")
INGREDIENTS = ("flour", "lentils", "butter", "ginger", "rice", "chickpeas", "spinach", "honey", "garlic",
               "tomatoes", "yoghurt", "cumin", "onions", "walnuts", "lemon zest", "oats")
KITCHEN_UNITS = ("grams of", "cups of", "tablespoons of", "teaspoons of", "pinches of", "handfuls of")
COOKING = ("whisk", "simmer", "fold in", "roast", "stir", "season", "knead", "toast", "blend", "chill")
LOG_LEVELS = ("INFO", "WARN", "DEBUG", "ERROR")
LOG_EVENTS = ("processed {n} items in {f} ms", "retrying request {h} after {n} ms",
              "cache hit ratio {f}%", "connection from 10.{m}.{b}.{k} closed", "flushed {n} rows to disk",
              "queue depth {n}", "checkpoint {h} written", "worker restarted after {n} s")
LEGAL_PARTIES = ("the Supplier", "the Customer", "the Licensee", "the Tenant", "the Contractor", "the Buyer")
LEGAL_DUTIES = ("shall notify {p} in writing within {n} days", "shall not assign this agreement without consent",
                "shall keep all records for {n} years", "shall pay the invoiced amount within {n} days",
                "may terminate this agreement on {n} days' notice", "shall insure the goods against loss")
TOPICS = ("the delivery schedule", "the budget review", "the new office", "the audit findings",
          "next quarter's hiring", "the safety inspection", "the software release", "the research grant")
IDENTIFIERS = ("total", "count", "items", "buffer", "offset", "result", "limit", "index", "score", "weights",
               "queue", "window", "record", "batch", "prefix", "cursor")
FUNC_VERBS = ("compute", "merge", "parse", "filter", "update", "normalise", "collect", "split", "encode", "rank")

GENRES = ("story", "report", "manual", "code", "dialogue", "recipe", "log", "legal", "letter")


# ------------------------------------------------------------------ atoms
def person_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"


def access_code(rng: random.Random) -> str:
    """A 6-digit number (no leading zero, so it reads as one number)."""
    return str(rng.randint(100_000, 999_999))


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1995, 2031)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _money(rng: random.Random) -> str:
    return f"{rng.uniform(0.5, 950):.1f} million {rng.choice(('EUR', 'USD', 'JPY', 'GBP', 'CHF'))}"


# ------------------------------------------------------------------ sentences by genre
def _story(rng: random.Random) -> str:
    name = rng.choice(FIRST_NAMES)
    forms = (
        lambda: f"{name} walked to the {rng.choice(ADJECTIVES)} {rng.choice(PLACES)} in {rng.choice(CITIES)} "
                f"on a {rng.choice(WEATHER)} {rng.choice(DAYTIME)}.",
        lambda: f"Nobody noticed when {name} {rng.choice(ACTIONS)} the {rng.choice(OBJECTS)} near the "
                f"{rng.choice(PLACES)}.",
        lambda: f"By {rng.choice(DAYTIME)} the {rng.choice(PLACES)} was {rng.choice(ADJECTIVES)}, and "
                f"{rng.choice(FIRST_NAMES)} still had {rng.randint(2, 40)} letters to answer.",
        lambda: f"\"Keep the {rng.choice(OBJECTS)} dry,\" said {name}, \"we leave for {rng.choice(CITIES)} "
                f"at {rng.randint(5, 11)} o'clock.\"",
        lambda: f"The {rng.choice(OBJECTS)} that {name} {rng.choice(ACTIONS)} had belonged to "
                f"{person_name(rng)} for {rng.randint(3, 60)} years.",
    )
    return rng.choice(forms)()


def _report(rng: random.Random) -> str:
    company = rng.choice(COMPANIES)
    forms = (
        lambda: f"In Q{rng.randint(1, 4)} {rng.randint(2015, 2031)}, {rng.choice(METRICS)} at {company} "
                f"{rng.choice(TRENDS)} by {rng.uniform(0.3, 48):.1f}% to {_money(rng)}.",
        lambda: f"{company} reported {rng.choice(METRICS)} of {_money(rng)}, against {_money(rng)} a year earlier.",
        lambda: f"Analysts expect {rng.choice(METRICS)} to {rng.choice(('stabilise', 'improve', 'weaken'))} "
                f"as the {rng.choice(CITIES)} plant reaches {rng.randint(40, 99)}% utilisation.",
        lambda: f"The board approved a dividend of {rng.uniform(0.05, 4):.2f} per share, payable on {_date(rng)}.",
    )
    return rng.choice(forms)()


def _manual(rng: random.Random) -> str:
    k = rng.randrange(len(PARAMETERS))
    forms = (
        lambda: f"To {rng.choice(TECH_VERBS)} the {rng.choice(COMPONENTS)}, first {rng.choice(TECH_VERBS)} the "
                f"{rng.choice(COMPONENTS)} and set the {PARAMETERS[k]} to {rng.randint(1, 900)} {UNITS[k]}.",
        lambda: f"If the {rng.choice(COMPONENTS)} reports error E{rng.randint(100, 999)}, "
                f"{rng.choice(TECH_VERBS)} it and wait {rng.randint(2, 120)} seconds.",
        lambda: f"Step {rng.randint(1, 12)}: check that the {PARAMETERS[k]} stays below "
                f"{rng.uniform(1, 500):.1f} {UNITS[k]} during start-up.",
        lambda: f"Warning: never {rng.choice(TECH_VERBS)} the {rng.choice(COMPONENTS)} while the "
                f"{rng.choice(COMPONENTS)} is powered.",
    )
    return rng.choice(forms)()


def _dialogue(rng: random.Random) -> str:
    a, b = rng.sample(FIRST_NAMES, 2)
    forms = (
        lambda: f"{a}: Did you see the notes on {rng.choice(TOPICS)}?\n{b}: Not yet, send them before {rng.randint(1, 12)} pm.",
        lambda: f"{a}: We are {rng.randint(2, 30)} units short for {rng.choice(CITIES)}.\n{b}: Then move the order to {_date(rng)}.",
        lambda: f"{a}: Who has the {rng.choice(OBJECTS)}?\n{b}: {rng.choice(FIRST_NAMES)} took it to the {rng.choice(PLACES)}.",
    )
    return rng.choice(forms)()


def _recipe(rng: random.Random) -> str:
    forms = (
        lambda: f"{rng.choice(COOKING).capitalize()} {rng.randint(1, 500)} {rng.choice(KITCHEN_UNITS)} "
                f"{rng.choice(INGREDIENTS)} with the {rng.choice(INGREDIENTS)} for {rng.randint(2, 45)} minutes.",
        lambda: f"Heat the oven to {rng.choice((160, 170, 180, 190, 200, 220))} degrees and "
                f"{rng.choice(COOKING)} the {rng.choice(INGREDIENTS)}.",
        lambda: f"Serve with {rng.choice(INGREDIENTS)} and a little {rng.choice(INGREDIENTS)}.",
    )
    return rng.choice(forms)()


def _log(rng: random.Random) -> str:
    event = rng.choice(LOG_EVENTS).format(n=rng.randint(0, 9999), m=rng.randint(0, 255), b=rng.randint(0, 255),
                                          k=rng.randint(1, 254),
                                          f=f"{rng.uniform(0, 100):.2f}", h=f"{rng.getrandbits(32):08x}")
    return (f"{_date(rng)} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} "
            f"{rng.choice(LOG_LEVELS)} worker-{rng.randint(0, 31)} {event}")


def _legal(rng: random.Random) -> str:
    party = rng.choice(LEGAL_PARTIES)
    duty = rng.choice(LEGAL_DUTIES).format(p=rng.choice(LEGAL_PARTIES), n=rng.randint(2, 90))
    return f"{rng.randint(1, 20)}.{rng.randint(1, 9)} {party} {duty}."


def _letter(rng: random.Random) -> str:
    forms = (
        lambda: f"Dear {person_name(rng)}, thank you for your note about {rng.choice(TOPICS)}.",
        lambda: f"I will be in {rng.choice(CITIES)} from {_date(rng)} and can meet at the {rng.choice(PLACES)}.",
        lambda: f"Please find attached the figures for {rng.choice(TOPICS)}; the total is {_money(rng)}.",
        lambda: f"Kind regards, {person_name(rng)}",
    )
    return rng.choice(forms)()


def code_snippet(rng: random.Random, lines: tuple[int, int] = (3, 9)) -> str:
    """A small Python-like function."""
    name = f"{rng.choice(FUNC_VERBS)}_{rng.choice(IDENTIFIERS)}"
    args = rng.sample(IDENTIFIERS, rng.randint(1, 3))
    body = []
    for _ in range(rng.randint(*lines)):
        a, b = rng.choice(IDENTIFIERS), rng.choice(args)
        body.append(rng.choice((
            f"    {a} = {b} * {rng.randint(2, 64)} + {rng.randint(0, 9)}",
            f"    if {b} > {rng.randint(0, 1000)}:\n        {a} = {a} - {rng.randint(1, 9)}",
            f"    for i in range({rng.randint(2, 128)}):\n        {a} += {b}[i] if i < len({b}) else 0",
            f"    {a} = sorted({b}, key=lambda x: x % {rng.randint(2, 17)})",
        )))
    return f"def {name}({', '.join(args)}):\n" + "\n".join(body) + f"\n    return {rng.choice(args)}"


_SENTENCES = {
    "story": _story, "report": _report, "manual": _manual, "dialogue": _dialogue,
    "recipe": _recipe, "log": _log, "legal": _legal, "letter": _letter,
}


def paragraph(rng: random.Random, genre: str | None = None) -> str:
    """A paragraph of one genre (random when None)."""
    genre = genre or rng.choice(GENRES)
    if genre == "code":
        return code_snippet(rng)
    if genre not in _SENTENCES:
        raise ValueError(f"unknown genre {genre!r}; use one of {GENRES}")
    make = _SENTENCES[genre]
    joiner = "\n" if genre in ("log", "dialogue", "legal") else " "
    return joiner.join(make(rng) for _ in range(rng.randint(3, 7)))


def paragraphs(rng: random.Random, approx_chars: int) -> list[str]:
    """Paragraphs of mixed genres adding up to at least `approx_chars` characters. Genres come in
    runs, as sections of a longer document would."""
    out, total = [], 0
    genre = rng.choice(GENRES)
    while total < approx_chars:
        if rng.random() < 0.3:
            genre = rng.choice(GENRES)
        text = paragraph(rng, genre)
        out.append(text)
        total += len(text) + 2
    return out


def planted_fact(subject: str, value: str) -> str:
    return f"The access code for {subject} is {value}."


def planted_question(subject: str) -> str:
    return f"What is the access code for {subject}? Reply with the number only."


__all__ = [
    "GENRES", "person_name", "access_code", "code_snippet", "paragraph", "paragraphs",
    "planted_fact", "planted_question",
]
