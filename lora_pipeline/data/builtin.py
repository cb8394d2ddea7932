"""Deterministic multilingual arithmetic reasoning rows in the HuggingFaceH4/Multilingual-Thinking schema."""

from __future__ import annotations

import random
from collections.abc import Sequence

from lora_pipeline.config.params import LANGUAGE_NAMES

LANGUAGES = {code: LANGUAGE_NAMES[code] for code in ("en", "de", "es", "fr", "it")}  # those TEMPLATES is written in

DEVELOPER_PROMPTS = (
    "You are a helpful assistant that solves arithmetic word problems.",
    "You are a patient math tutor. Solve the word problem step by step.",
    "You are an assistant that answers simple math questions.",
    "Solve the user's arithmetic problem and give a short final answer.",
    "You are a careful assistant. Work out the calculation before answering.",
)

# (name, grammatical gender of the pronoun that refers to the person)
NAMES = (
    ("Anna", "f"), ("Marco", "m"), ("Lea", "f"), ("Paul", "m"), ("Sofia", "f"),
    ("Luca", "m"), ("Emma", "f"), ("David", "m"), ("Clara", "f"), ("Leo", "m"),
    ("Nina", "f"), ("Hugo", "m"), ("Julia", "f"), ("Tom", "m"),
)

# Per language: (singular, plural, gender); gender drives es/it agreement (cuántos/cuántas, altri/altre).
ITEMS = (
    {"en": ("apple", "apples", "n"), "de": ("Apfel", "Äpfel", "m"), "es": ("manzana", "manzanas", "f"),
     "fr": ("pomme", "pommes", "f"), "it": ("mela", "mele", "f")},
    {"en": ("pencil", "pencils", "n"), "de": ("Bleistift", "Bleistifte", "m"), "es": ("lápiz", "lápices", "m"),
     "fr": ("crayon", "crayons", "m"), "it": ("matita", "matite", "f")},
    {"en": ("book", "books", "n"), "de": ("Buch", "Bücher", "n"), "es": ("libro", "libros", "m"),
     "fr": ("livre", "livres", "m"), "it": ("libro", "libri", "m")},
    {"en": ("cookie", "cookies", "n"), "de": ("Keks", "Kekse", "m"), "es": ("galleta", "galletas", "f"),
     "fr": ("biscuit", "biscuits", "m"), "it": ("biscotto", "biscotti", "m")},
    {"en": ("sticker", "stickers", "n"), "de": ("Aufkleber", "Aufkleber", "m"), "es": ("pegatina", "pegatinas", "f"),
     "fr": ("autocollant", "autocollants", "m"), "it": ("adesivo", "adesivi", "m")},
    {"en": ("marble", "marbles", "n"), "de": ("Murmel", "Murmeln", "f"), "es": ("canica", "canicas", "f"),
     "fr": ("bille", "billes", "f"), "it": ("biglia", "biglie", "f")},
    {"en": ("orange", "oranges", "n"), "de": ("Orange", "Orangen", "f"), "es": ("naranja", "naranjas", "f"),
     "fr": ("orange", "oranges", "f"), "it": ("arancia", "arance", "f")},
    {"en": ("postcard", "postcards", "n"), "de": ("Postkarte", "Postkarten", "f"), "es": ("postal", "postales", "f"),
     "fr": ("carte postale", "cartes postales", "f"), "it": ("cartolina", "cartoline", "f")},
    {"en": ("balloon", "balloons", "n"), "de": ("Luftballon", "Luftballons", "m"), "es": ("globo", "globos", "m"),
     "fr": ("ballon", "ballons", "m"), "it": ("palloncino", "palloncini", "m")},
    {"en": ("flower", "flowers", "n"), "de": ("Blume", "Blumen", "f"), "es": ("flor", "flores", "f"),
     "fr": ("fleur", "fleurs", "f"), "it": ("fiore", "fiori", "m")},
    {"en": ("pear", "pears", "n"), "de": ("Birne", "Birnen", "f"), "es": ("pera", "peras", "f"),
     "fr": ("poire", "poires", "f"), "it": ("pera", "pere", "f")},
    {"en": ("candle", "candles", "n"), "de": ("Kerze", "Kerzen", "f"), "es": ("vela", "velas", "f"),
     "fr": ("bougie", "bougies", "f"), "it": ("candela", "candele", "f")},
)

# (singular, plural); the templates only use invariable "each" words, except German where all are feminine.
CONTAINERS = (
    {"en": ("box", "boxes"), "de": ("Schachtel", "Schachteln"), "es": ("caja", "cajas"),
     "fr": ("boîte", "boîtes"), "it": ("scatola", "scatole")},
    {"en": ("bag", "bags"), "de": ("Tüte", "Tüten"), "es": ("bolsa", "bolsas"),
     "fr": ("sac", "sacs"), "it": ("sacchetto", "sacchetti")},
    {"en": ("basket", "baskets"), "de": ("Kiste", "Kisten"), "es": ("cesta", "cestas"),
     "fr": ("panier", "paniers"), "it": ("cestino", "cestini")},
)

# (plural, "each <one>")
RECIPIENTS = (
    {"en": ("friends", "each friend"), "de": ("Freunde", "jeder Freund"), "es": ("amigos", "cada amigo"),
     "fr": ("amis", "chaque ami"), "it": ("amici", "ogni amico")},
    {"en": ("children", "each child"), "de": ("Kinder", "jedes Kind"), "es": ("niños", "cada niño"),
     "fr": ("enfants", "chaque enfant"), "it": ("bambini", "ogni bambino")},
)

PROBLEM_TYPES = ("add", "sub", "mul", "div", "two_step", "price", "compare")

# Placeholders: {a} {b} {c} numbers, {s} intermediate, {r} result; {A} {B} {C} {R} the same with the item noun;
# {Ip}/{Is} item plural/singular, {Cp} "<a> boxes", {Cs}/{Cpl} container singular/plural,
# {RP} "<b> friends", {each}/{Each} "each friend". Language-specific extras come from _extras().
TEMPLATES = {
    "en": {
        "add": (
            "{name} has {A}. {She} gets another {B}. How many {Ip} does {name} have now?",
            "At the beginning {name} has {A}, and then {she} gets another {B}. To find the new total, "
            "we add the two amounts: {a} + {b} = {r}. So {name} now has {R}.",
            "{name} now has {R}.",
        ),
        "sub": (
            "{name} has {A}. {She} gives away {B}. How many {Ip} does {name} have left?",
            "At the beginning {name} has {A}, and {she} gives away {B}. To find out how many are left, "
            "we subtract the second number from the first: {a} - {b} = {r}. So {name} has {R} left.",
            "{name} has {R} left.",
        ),
        "mul": (
            "{name} has {Cp}. Each {Cs} contains {B}. How many {Ip} does {name} have in total?",
            "There are {Cp}, and each {Cs} contains {B}. To get the total, we multiply the number of {Cpl} "
            "by the number of {Ip} in each one: {a} × {b} = {r}. So {name} has {R} in total.",
            "{name} has {R} in total.",
        ),
        "div": (
            "{name} shares {A} equally among {RP}. How many {Ip} does {each} get?",
            "{name} shares {A} equally among {RP}. To find out how many {Ip} each of them gets, "
            "we divide the total by the number of {Rpl}: {a} ÷ {b} = {r}. So {each} gets {R}.",
            "{Each} gets {R}.",
        ),
        "two_step": (
            "{name} buys {A} in the morning and {B} in the afternoon. Then {she} gives away {C}. "
            "How many {Ip} does {name} have now?",
            "{name} first buys {A} and then another {B}, so we add them: {a} + {b} = {s}. "
            "After that {she} gives away {C}, so we subtract: {s} - {c} = {r}. "
            "This means that {name} now has {R}.",
            "{name} now has {R}.",
        ),
        "price": (
            "{name} buys {A} at {b} euros each. How much does {name} pay in total?",
            "{name} buys {A}, and each {Is} costs {b} euros. To find the total price, we multiply the number "
            "of {Ip} by the price of one {Is}: {a} × {b} = {r}. So {name} pays {r} euros in total.",
            "{name} pays {r} euros in total.",
        ),
        "compare": (
            "{name} has {A}. {name2} has {b} more {Ip} than {name}. How many {Ip} does {name2} have?",
            "{name} has {A}, and {name2} has {b} more than {name}. To find how many {Ip} {name2} has, "
            "we add the difference to the first amount: {a} + {b} = {r}. So {name2} has {R}.",
            "{name2} has {R}.",
        ),
    },
    "de": {
        "add": (
            "{name} hat {A}. {Sie} bekommt noch {B} dazu. Wie viele {Ip} hat {name} jetzt?",
            "Am Anfang hat {name} {A}, und dann bekommt {sie} noch {B} dazu. Um die neue Anzahl zu finden, "
            "addieren wir die beiden Zahlen: {a} + {b} = {r}. Also hat {name} jetzt {R}.",
            "{name} hat jetzt {R}.",
        ),
        "sub": (
            "{name} hat {A}. {Sie} verschenkt {B}. Wie viele {Ip} hat {name} noch?",
            "Am Anfang hat {name} {A}, und {sie} verschenkt davon {B}. Um den Rest zu finden, ziehen wir "
            "die zweite Zahl von der ersten ab: {a} - {b} = {r}. Also hat {name} noch {R}.",
            "{name} hat noch {R}.",
        ),
        "mul": (
            "{name} hat {Cp}. In jeder {Cs} sind {B}. Wie viele {Ip} hat {name} insgesamt?",
            "Es gibt {Cp}, und in jeder {Cs} sind {B}. Um die Gesamtzahl zu finden, multiplizieren wir die "
            "Anzahl der {Cpl} mit der Anzahl der {Ip} pro {Cs}: {a} × {b} = {r}. Also hat {name} insgesamt {R}.",
            "{name} hat insgesamt {R}.",
        ),
        "div": (
            "{name} verteilt {A} gleichmäßig an {RP}. Wie viele {Ip} bekommt {each}?",
            "{name} verteilt {A} gleichmäßig an {RP}. Um herauszufinden, wie viele {Ip} {each} "
            "bekommt, teilen wir die Gesamtzahl durch die Anzahl der {Rpl}: {a} ÷ {b} = {r}. "
            "Also bekommt {each} {R}.",
            "{Each} bekommt {R}.",
        ),
        "two_step": (
            "{name} kauft am Morgen {A} und am Nachmittag {B}. Danach verschenkt {sie} {C}. "
            "Wie viele {Ip} hat {name} jetzt?",
            "{name} kauft zuerst {A} und danach noch {B}, also addieren wir zuerst: {a} + {b} = {s}. "
            "Dann verschenkt {sie} {C}, deshalb ziehen wir diese Zahl ab: {s} - {c} = {r}. "
            "Das bedeutet, dass {name} jetzt {R} hat.",
            "{name} hat jetzt {R}.",
        ),
        "price": (
            "{name} kauft {A} zu je {b} Euro. Wie viel bezahlt {name} insgesamt?",
            "{name} kauft {A}, und ein Stück kostet {b} Euro. Um den Gesamtpreis zu berechnen, multiplizieren "
            "wir die Anzahl mit dem Preis pro Stück: {a} × {b} = {r}. Also bezahlt {name} insgesamt {r} Euro.",
            "{name} bezahlt insgesamt {r} Euro.",
        ),
        "compare": (
            "{name} hat {A}. {name2} hat {b} {Ip} mehr als {name}. Wie viele {Ip} hat {name2}?",
            "{name} hat {A}, und {name2} hat {b} mehr als {name}. Um zu finden, wie viele {Ip} {name2} hat, "
            "addieren wir den Unterschied zu der ersten Zahl: {a} + {b} = {r}. Also hat {name2} {R}.",
            "{name2} hat {R}.",
        ),
    },
    "es": {
        "add": (
            "{name} tiene {A}. Recibe {B} más. ¿{Cuantas} {Ip} tiene {name} ahora?",
            "Al principio {name} tiene {A} y después recibe {B} más. Para calcular el nuevo total, "
            "sumamos las dos cantidades: {a} + {b} = {r}. Por lo tanto, {name} tiene ahora {R}.",
            "{name} tiene ahora {R}.",
        ),
        "sub": (
            "{name} tiene {A}. Regala {B} a sus amigos. ¿{Cuantas} {Ip} le quedan a {name}?",
            "Al principio {name} tiene {A} y regala {B}. Para saber {cuantas} {Ip} le quedan, "
            "restamos el segundo número del primero: {a} - {b} = {r}. Por lo tanto, a {name} le quedan {R}.",
            "A {name} le quedan {R}.",
        ),
        "mul": (
            "{name} tiene {Cp}. Cada {Cs} contiene {B}. ¿{Cuantas} {Ip} tiene {name} en total?",
            "Hay {Cp} y en cada {Cs} hay {B}. Para obtener el total, multiplicamos el número de {Cpl} "
            "por el número de {Ip} de cada {Cs}: {a} × {b} = {r}. Por lo tanto, {name} tiene {R} en total.",
            "{name} tiene {R} en total.",
        ),
        "div": (
            "{name} reparte {A} a partes iguales entre {RP}. ¿{Cuantas} {Ip} recibe {each}?",
            "{name} reparte {A} a partes iguales entre {RP}. Para saber {cuantas} {Ip} recibe {each}, "
            "dividimos el total entre el número de {Rpl}: {a} ÷ {b} = {r}. Por lo tanto, {each} recibe {R}.",
            "{Each} recibe {R}.",
        ),
        "two_step": (
            "{name} compra {A} por la mañana y {B} por la tarde. Después regala {C}. "
            "¿{Cuantas} {Ip} tiene {name} ahora?",
            "{name} compra primero {A} y luego {B}, así que primero sumamos: {a} + {b} = {s}. "
            "Después regala {C}, así que restamos esa cantidad: {s} - {c} = {r}. "
            "Esto significa que {name} tiene ahora {R}.",
            "{name} tiene ahora {R}.",
        ),
        "price": (
            "{name} compra {A} a {b} euros {cada_uno}. ¿Cuánto paga {name} en total?",
            "{name} compra {A} y cada {Is} cuesta {b} euros. Para calcular el precio total, multiplicamos "
            "la cantidad por el precio de cada {Is}: {a} × {b} = {r}. Por lo tanto, {name} paga {r} euros en total.",
            "{name} paga {r} euros en total.",
        ),
        "compare": (
            "{name} tiene {A}. {name2} tiene {b} {Ip} más que {name}. ¿{Cuantas} {Ip} tiene {name2}?",
            "{name} tiene {A} y {name2} tiene {b} más que {name}. Para saber {cuantas} {Ip} tiene {name2}, "
            "sumamos la diferencia a la primera cantidad: {a} + {b} = {r}. Por lo tanto, {name2} tiene {R}.",
            "{name2} tiene {R}.",
        ),
    },
    "fr": {
        "add": (
            "{name} a {A}. {Elle} reçoit encore {B}. Combien {de_Ip} {name} a-t-{elle} maintenant ?",
            "Au début, {name} a {A}, puis {elle} en reçoit encore {b}. Pour trouver le nouveau total, "
            "on additionne les deux nombres : {a} + {b} = {r}. Donc {name} a maintenant {R}.",
            "{name} a maintenant {R}.",
        ),
        "sub": (
            "{name} a {A}. {Elle} donne {B} à ses amis. Combien {de_Ip} reste-t-il à {name} ?",
            "Au début, {name} a {A}, et {elle} en donne {b}. Pour savoir combien il en reste, "
            "on soustrait le deuxième nombre du premier : {a} - {b} = {r}. Donc il reste {R} à {name}.",
            "Il reste {R} à {name}.",
        ),
        "mul": (
            "{name} a {Cp}. Dans chaque {Cs}, il y a {B}. Combien {de_Ip} {name} a-t-{elle} au total ?",
            "Il y a {Cp}, et dans chaque {Cs}, il y a {B}. Pour obtenir le total, on multiplie le nombre "
            "de {Cpl} par le nombre {de_Ip} dans chaque {Cs} : {a} × {b} = {r}. Donc {name} a {R} au total.",
            "{name} a {R} au total.",
        ),
        "div": (
            "{name} partage {A} équitablement entre {RP}. Combien {de_Ip} reçoit {each} ?",
            "{name} partage {A} équitablement entre {RP}. Pour savoir combien {de_Ip} reçoit {each}, "
            "on divise le total par le nombre {de_Rpl} : {a} ÷ {b} = {r}. Donc {each} reçoit {R}.",
            "{Each} reçoit {R}.",
        ),
        "two_step": (
            "{name} achète {A} le matin et {B} l'après-midi. Ensuite, {elle} donne {C}. "
            "Combien {de_Ip} {name} a-t-{elle} maintenant ?",
            "{name} achète d'abord {A}, puis {B}, donc on commence par additionner : {a} + {b} = {s}. "
            "Ensuite, {elle} donne {C}, donc on soustrait : {s} - {c} = {r}. "
            "Cela veut dire {que_name} a maintenant {R}.",
            "{name} a maintenant {R}.",
        ),
        "price": (
            "{name} achète {A} à {b} euros pièce. Combien {name} paie-t-{elle} au total ?",
            "{name} achète {A}, et chaque {Is} coûte {b} euros. Pour trouver le prix total, on multiplie "
            "la quantité par le prix d'une seule pièce : {a} × {b} = {r}. Donc {name} paie {r} euros au total.",
            "{name} paie {r} euros au total.",
        ),
        "compare": (
            "{name} a {A}. {name2} possède {b} {Ip} de plus {que_name}. Combien {de_Ip} {name2} possède-t-{elle2} ?",
            "{name} a {A}, et {name2} en a {b} de plus {que_name}. Pour trouver combien {de_Ip} a {name2}, "
            "on ajoute la différence au premier nombre : {a} + {b} = {r}. Donc {name2} a {R}.",
            "{name2} a {R}.",
        ),
    },
    "it": {
        "add": (
            "{name} ha {A}. Poi riceve {altre} {B} in regalo. {Quante} {Ip} ha {name} adesso?",
            "All'inizio {name} ha {A} e poi riceve {altre} {B}. Per trovare il nuovo totale, "
            "sommiamo i due numeri: {a} + {b} = {r}. Quindi adesso {name} ha {R}.",
            "Adesso {name} ha {R}.",
        ),
        "sub": (
            "{name} ha {A}. Regala {B} ai suoi amici. {Quante} {Ip} ha ancora {name}?",
            "All'inizio {name} ha {A} e ne regala {b}. Per sapere {quante} ne restano, sottraiamo "
            "il secondo numero dal primo: {a} - {b} = {r}. Quindi {name} ha ancora {R}.",
            "{name} ha ancora {R}.",
        ),
        "mul": (
            "{name} ha {Cp}. In ogni {Cs} ci sono {B}. {Quante} {Ip} ha {name} in totale?",
            "Ci sono {Cp} e in ogni {Cs} ci sono {B}. Per trovare il totale, moltiplichiamo il numero di {Cpl} "
            "per il numero di {Ip} in ogni {Cs}: {a} × {b} = {r}. Quindi {name} ha {R} in totale.",
            "{name} ha {R} in totale.",
        ),
        "div": (
            "{name} divide {A} in parti uguali tra {RP}. {Quante} {Ip} riceve {each}?",
            "{name} divide {A} in parti uguali tra {RP}. Per sapere {quante} {Ip} riceve {each}, "
            "dividiamo il totale per il numero di {Rpl}: {a} ÷ {b} = {r}. Quindi {each} riceve {R}.",
            "{Each} riceve {R}.",
        ),
        "two_step": (
            "{name} compra {A} la mattina e {B} il pomeriggio. Poi regala {C}. {Quante} {Ip} ha {name} adesso?",
            "{name} compra prima {A} e poi {B}, quindi per prima cosa sommiamo: {a} + {b} = {s}. "
            "Dopo regala {C}, quindi sottraiamo questo numero: {s} - {c} = {r}. "
            "Questo significa che adesso {name} ha {R}.",
            "Adesso {name} ha {R}.",
        ),
        "price": (
            "{name} compra {A} a {b} euro {ciascuna}. Quanti euro spende {name} in tutto?",
            "{name} compra {A} e ogni {Is} costa {b} euro. Per trovare il prezzo totale, moltiplichiamo "
            "la quantità per il prezzo di ogni {Is}: {a} × {b} = {r}. Quindi {name} spende {r} euro in totale.",
            "{name} spende {r} euro in tutto.",
        ),
        "compare": (
            "{name} ha {A}. {name2} ha {b} {Ip} in più di {name}. {Quante} {Ip} ha {name2}?",
            "{name} ha {A} e {name2} ne ha {b} in più di {name}. Per sapere {quante} {Ip} ha {name2}, "
            "sommiamo la differenza al primo numero: {a} + {b} = {r}. Quindi {name2} ha {R}.",
            "{name2} ha {R}.",
        ),
    },
}


def _numbers(kind: str, rng: random.Random) -> dict:
    """Draw operands for one problem; every count shown next to a noun is >= 2 and every result exact."""
    c = s = 0
    if kind == "add":
        a = rng.randint(2, 40)
        b = rng.randint(2, 60 - a)
        r = a + b
    elif kind == "sub":
        a = rng.randint(6, 60)
        b = rng.randint(2, a - 2)
        r = a - b
    elif kind in ("mul", "price"):
        a = rng.randint(2, 6)
        b = rng.randint(2, 10)
        r = a * b
    elif kind == "div":
        b = rng.randint(2, 6)
        r = rng.randint(2, 10)
        a = b * r
    elif kind == "two_step":
        a = rng.randint(2, 30)
        b = rng.randint(2, 25)
        s = a + b
        c = rng.randint(2, s - 2)
        r = s - c
    elif kind == "compare":
        a = rng.randint(2, 40)
        b = rng.randint(2, 20)
        r = a + b
    else:
        raise ValueError(f"unknown problem type {kind!r}; valid: {', '.join(PROBLEM_TYPES)}")
    return {"a": a, "b": b, "c": c, "s": s, "r": r}


def _fr_elide(word: str, short: str) -> str:
    """French elision: 'de orange' -> "d'orange", 'que Anna' -> "qu'Anna"."""
    if word[0].lower() in "aeiouhéèêœ":
        return f"{short[:-1]}'{word}"
    return f"{short} {word}"


def _extras(lang: str, gender: str, gender2: str, item_gender: str, item_pl: str, rec_pl: str, name: str) -> dict:
    """Gender/elision dependent words for one language."""
    if lang == "en":
        return {"She": "She" if gender == "f" else "He", "she": "she" if gender == "f" else "he"}
    if lang == "de":
        return {"Sie": "Sie" if gender == "f" else "Er", "sie": "sie" if gender == "f" else "er"}
    if lang == "fr":
        return {
            "Elle": "Elle" if gender == "f" else "Il",
            "elle": "elle" if gender == "f" else "il",
            "elle2": "elle" if gender2 == "f" else "il",
            "de_Ip": _fr_elide(item_pl, "de"),
            "de_Rpl": _fr_elide(rec_pl, "de"),
            "que_name": _fr_elide(name, "que"),
        }
    fem = item_gender == "f"
    if lang == "es":
        return {
            "Cuantas": "Cuántas" if fem else "Cuántos",
            "cuantas": "cuántas" if fem else "cuántos",
            "cada_uno": "cada una" if fem else "cada uno",
        }
    return {  # it
        "Quante": "Quante" if fem else "Quanti",
        "quante": "quante" if fem else "quanti",
        "altre": "altre" if fem else "altri",
        "ciascuna": "ciascuna" if fem else "ciascuno",
    }


def _render(kind: str, lang: str, nums: dict, names: tuple, item: dict, container: dict, recipient: dict) -> tuple:
    """Fill the (question, analysis, final) templates of one language."""
    (name, gender), (name2, gender2) = names
    sing, plur, item_gender = item[lang]
    cont_sing, cont_pl = container[lang]
    rec_pl, each = recipient[lang]

    def count(n: int, forms: tuple) -> str:
        return f"{n} {forms[0] if n == 1 else forms[1]}"

    ctx = dict(nums)
    ctx.update(
        name=name, name2=name2, Is=sing, Ip=plur, Cs=cont_sing, Cpl=cont_pl, Rpl=rec_pl,
        each=each, Each=each[0].upper() + each[1:],
        A=count(nums["a"], (sing, plur)), B=count(nums["b"], (sing, plur)),
        C=count(nums["c"], (sing, plur)), R=count(nums["r"], (sing, plur)),
        Cp=count(nums["a"], (cont_sing, cont_pl)), RP=f"{nums['b']} {rec_pl}",
    )
    ctx.update(_extras(lang, gender, gender2, item_gender, plur, rec_pl, name))
    return tuple(t.format(**ctx) for t in TEMPLATES[lang][kind])


def _check_args(rows: int, languages: Sequence[str]) -> list[str]:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    valid = ", ".join(LANGUAGES)
    if isinstance(languages, str) or not languages:
        raise ValueError(f"languages must be a non-empty list of codes, got {languages!r}; valid: {valid}")
    for code in languages:
        if code not in LANGUAGES:
            raise ValueError(f"unknown language {code!r}; valid: {valid}")
    return list(languages)


def _generate_typed(rows: int, seed: int, languages: Sequence[str] = tuple(LANGUAGES)) -> list[tuple[str, dict]]:
    """Like generate(), but each row comes with its problem type: [(type, row), ...]."""
    languages = _check_args(rows, languages)
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        kind = rng.choice(PROBLEM_TYPES)
        names = tuple(rng.sample(NAMES, 2))
        item = rng.choice(ITEMS)
        container = rng.choice(CONTAINERS)
        recipient = rng.choice(RECIPIENTS)
        nums = _numbers(kind, rng)
        user_lang = rng.choice(languages)
        reasoning_lang = rng.choice(languages)
        developer = rng.choice(DEVELOPER_PROMPTS)

        user, _, final = _render(kind, user_lang, nums, names, item, container, recipient)
        _, analysis, _ = _render(kind, reasoning_lang, nums, names, item, container, recipient)
        reasoning_language = LANGUAGES[reasoning_lang]
        out.append((kind, {
            "reasoning_language": reasoning_language,
            "developer": developer,
            "user": user,
            "analysis": analysis,
            "final": final,
            "answer": nums["r"],
            "user_language": user_lang,
            "messages": [
                {"role": "system", "content": f"reasoning language: {reasoning_language}\n\n{developer}",
                 "thinking": None},
                {"role": "user", "content": user, "thinking": None},
                {"role": "assistant", "content": final, "thinking": analysis},
            ],
        }))
    return out


def generate(rows: int, seed: int, languages: Sequence[str] = tuple(LANGUAGES)) -> list[dict]:
    """Deterministic: same (rows, seed, languages) -> identical output (use random.Random(seed), no global RNG)."""
    return [row for _, row in _generate_typed(rows, seed, languages)]
