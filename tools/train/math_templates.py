"""Math prompts: word problems and exercises with seeded numbers and names, written for this project.

`math_prompt(rng)` returns (template name, prompt text): a random generator plus an answer-style suffix. The
themes stay away from the hand-written held-out problems of bench/prompts/heldout.json (no heads-and-legs
puzzles, ladders, marble draws, doubling cultures, ticket mixes, round-trip averages, garden paths or age
ratios; check_heldout.py verifies the wording).
"""

from __future__ import annotations

import random

STEP_SUFFIXES = ("", " Show your steps.", " Explain your reasoning step by step.", " Give the final answer first.",
                 " Check your answer at the end.", " Answer in one line, then explain.")

NAMES = ("Ava", "Ben", "Chen", "Dara", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemal", "Lena", "Marta",
         "Nico", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Viktor", "Wen", "Yara", "Zoe")
COUNTABLES = ("apples", "marbles", "stickers", "books", "pencils", "coins", "cookies", "stamps", "shells", "cards")
SHOP_ITEMS = ("jacket", "lamp", "bicycle", "backpack", "kettle", "chair", "watch", "pair of shoes", "desk", "radio")


def _name(rng: random.Random) -> str:
    return rng.choice(NAMES)


def _m_inventory(rng):
    n, item = _name(rng), rng.choice(COUNTABLES)
    a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
    return f"{n} has {a} {item}. {n} buys {b} more and then gives {c} to a friend. How many {item} does {n} have now?"


def _m_distance(rng):
    v, t = rng.randint(30, 120), rng.choice((1.5, 2, 2.5, 3, 4, 5))
    return f"A train travels at {v} km/h for {t} hours. How far does it go?"


def _m_discount(rng):
    p, d = rng.randint(20, 400), rng.choice((10, 15, 20, 25, 30, 40, 50))
    return f"A {rng.choice(SHOP_ITEMS)} costs ${p}. It is on sale for {d}% off. What is the sale price?"


def _m_arith(rng):
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 99)
    form = rng.choice((f"What is {a} + {b} - {c}?", f"What is {a} times {c}?", f"Compute {a} * {c} + {b}.",
                       f"What is {a * c} divided by {c}?", f"Calculate ({a} + {b}) * {c}."))
    return form


def _m_linear(rng):
    a, x, b = rng.randint(2, 12), rng.randint(-10, 20), rng.randint(-30, 30)
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {a * x + b}."


def _m_average(rng):
    values = [rng.randint(1, 100) for _ in range(rng.randint(4, 8))]
    return f"What is the average of these numbers: {', '.join(map(str, values))}?"


def _m_rectangle(rng):
    w, h = rng.randint(2, 40), rng.randint(2, 40)
    return f"A rectangle is {w} cm wide and {h} cm long. What are its area and its perimeter?"


def _m_pages(rng):
    n, p, q = _name(rng), rng.randint(8, 40), rng.randint(120, 900)
    return f"{n} reads {p} pages a day. How many days does {n} need to finish a book of {q} pages?"


def _m_minutes(rng):
    return f"Convert {rng.randint(61, 1000)} minutes into hours and minutes."


def _m_recipe(rng):
    a, b = rng.randint(2, 5), rng.choice((12, 18, 24, 30))
    c = b * rng.choice((2, 3)) // rng.choice((1, 2))
    return f"A recipe needs {a} cups of flour for {b} cookies. How much flour is needed for {c} cookies?"


def _m_fraction(rng):
    g = rng.randint(2, 12)
    a, b = rng.randint(1, 12) * g, rng.randint(13, 30) * g
    return f"Simplify the fraction {a}/{b}."


def _m_sequence(rng):
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    if rng.random() < 0.5:
        seq = [start + i * step for i in range(5)]
    else:
        seq = [start * (step // 2 + 1) ** i for i in range(5)]
    return f"What is the next number in the sequence {', '.join(map(str, seq))}?"


def _m_gcd(rng):
    g = rng.randint(2, 15)
    a, b = g * rng.randint(2, 30), g * rng.randint(2, 30)
    return rng.choice((f"Find the greatest common divisor of {a} and {b}.",
                       f"Find the least common multiple of {a // g} and {b // g}."))


def _m_prime(rng):
    return f"Is {rng.randint(20, 500)} a prime number? Explain how you checked."


def _m_tank(rng):
    a, r = rng.randint(100, 2000), rng.randint(5, 60)
    return (f"A tank holds {a} liters of water. A pump fills it at {r} liters per minute. "
            "How long does it take to fill the empty tank?")


def _m_workers(rng):
    n, d = rng.randint(2, 12), rng.randint(2, 30)
    m = rng.choice([k for k in range(2, 25) if k != n])
    return f"{n} workers can paint a fence in {d} days. How long would {m} workers take, working at the same rate?"


def _m_sum_diff(rng):
    x, y = rng.randint(10, 90), rng.randint(1, 60)
    return f"The sum of two numbers is {x + y} and their difference is {abs(x - y)}. What are the two numbers?"


def _m_circle(rng):
    return f"What is the area of a circle with a radius of {rng.randint(1, 30)} meters? Use pi = 3.14."


def _m_savings(rng):
    n, a = _name(rng), rng.randint(5, 80)
    b = a * rng.randint(3, 40) + rng.randint(0, a - 1)
    return f"{n} saves ${a} every week. How many weeks does {n} need to save at least ${b}?"


def _m_interest(rng):
    p, r, t = rng.randint(2, 50) * 100, rng.choice((2, 3, 4, 5, 6, 8)), rng.randint(1, 10)
    return f"How much simple interest does ${p} earn at {r}% per year over {t} years?"


def _m_squares(rng):
    a, b = rng.randint(5, 60), rng.randint(1, 40)
    return f"What is {a} squared minus {b} squared?"


def _m_packs(rng):
    k, n, m = rng.choice((6, 8, 10, 12)), rng.randint(10, 40), rng.randint(2, 5)
    return (f"Pencils are sold in packs of {k}. A teacher needs {m} pencils for each of {n} students. "
            "How many packs must she buy?")


def _m_stats(rng):
    values = sorted(rng.randint(1, 20) for _ in range(rng.randint(5, 9)))
    rng.shuffle(values)
    return f"Find the mean, the median and the mode of: {', '.join(map(str, values))}."


def _m_binary(rng):
    to_binary = f"Write {rng.randint(5, 255)} in binary."
    to_decimal = f"Convert the binary number {bin(rng.randint(5, 255))[2:]} to decimal."
    return rng.choice((to_binary, to_decimal))


def _m_percent(rng):
    a, b = rng.choice((5, 10, 12, 15, 20, 25, 35, 60, 75)), rng.randint(20, 800)
    return f"What is {a}% of {b}?"


def _m_age(rng):
    n1, n2 = rng.sample(NAMES, 2)
    a, d, k = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 10)
    return (f"{n1} is {d} years older than {n2}. In {k} years their ages will add up to {2 * (a + k) + d}. "
            f"How old is {n2} now?")


def _m_speed_time(rng):
    d, v = rng.randint(5, 60) * 10, rng.randint(4, 12) * 10
    return f"A car needs to travel {d} km at an average speed of {v} km/h. How long will the trip take?"


def _m_triangle(rng):
    a, b = rng.randint(3, 20), rng.randint(3, 20)
    return f"A right triangle has legs of {a} cm and {b} cm. How long is its hypotenuse?"


# ------------------------------------------------------------------------------------------- second generation

CITIES = ("Oslo", "Lima", "Accra", "Perth", "Quito", "Riga", "Tunis", "Hanoi", "Bergen", "Porto", "Cusco", "Graz")
UNITS = (("kilometres", "miles", 0.621371), ("kilograms", "pounds", 2.20462), ("litres", "US gallons", 0.264172),
         ("metres", "feet", 3.28084), ("centimetres", "inches", 0.393701))


def _m_convert(rng):
    a, b, _ = rng.choice(UNITS)
    return f"Convert {rng.randint(2, 250)} {a} to {b}."


def _m_celsius(rng):
    if rng.random() < 0.5:
        return f"Convert {rng.randint(-20, 45)} degrees Celsius to Fahrenheit."
    return f"Convert {rng.randint(0, 110)} degrees Fahrenheit to Celsius."


def _m_clock(rng):
    h1, m1 = rng.randint(6, 14), rng.choice((0, 5, 10, 15, 20, 30, 40, 45, 50))
    dur = rng.randint(25, 300)
    h2, m2 = divmod(h1 * 60 + m1 + dur, 60)
    return f"A meeting starts at {h1}:{m1:02d} and ends at {h2}:{m2:02d}. How long does it last?"


def _m_ratio(rng):
    a, b = rng.sample(range(1, 9), 2)
    total = (a + b) * rng.randint(5, 60)
    n1, n2 = rng.sample(NAMES, 2)
    return f"{n1} and {n2} share ${total} in the ratio {a}:{b}. How much does each of them get?"


def _m_percent_change(rng):
    a = rng.randint(20, 500)
    b = a + rng.choice((-1, 1)) * rng.randint(1, a // 2)
    return f"The price of a {rng.choice(SHOP_ITEMS)} changed from ${a} to ${b}. What is the percentage change?"


def _m_box(rng):
    a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 30)
    return f"A box is {a} cm long, {b} cm wide and {c} cm high. What are its volume and its surface area?"


def _m_cylinder(rng):
    return (f"A cylinder has a radius of {rng.randint(1, 15)} cm and a height of {rng.randint(2, 40)} cm. "
            "What is its volume? Use pi = 3.14.")


def _m_powers(rng):
    a, b = rng.randint(2, 9), rng.randint(2, 6)
    return rng.choice((f"What is {a} to the power of {b}?", f"Compute {a}^{b} - {b}^{a}.",
                       f"Which is larger, {a}^{b} or {b}^{a}?"))


def _m_sqrt(rng):
    n = rng.randint(2, 999)
    return rng.choice((f"Estimate the square root of {n} to one decimal place.",
                       f"What is the square root of {rng.randint(2, 40) ** 2}?"))


def _m_order_ops(rng):
    a, b, c, d = (rng.randint(2, 12) for _ in range(4))
    return rng.choice((f"Evaluate {a} + {b} * ({c} - {d}).", f"Evaluate ({a} + {b}) * {c} - {d} ** 2.",
                       f"What is {a * b} / {b} + {c} * {d}?"))


def _m_fraction_ops(rng):
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    op = rng.choice(("add", "subtract", "multiply", "divide"))
    words = {"add": f"Add {a}/{b} and {c}/{d}.", "subtract": f"Subtract {c}/{d} from {a}/{b}.",
             "multiply": f"Multiply {a}/{b} by {c}/{d}.", "divide": f"Divide {a}/{b} by {c}/{d}."}
    return words[op] + " Simplify the result."


def _m_decimals(rng):
    a, b = round(rng.uniform(0.5, 99), 2), round(rng.uniform(0.1, 12), 2)
    return rng.choice((f"What is {a} times {b}?", f"What is {a} + {b} - 0.75?", f"Divide {a} by 0.5."))


def _m_rounding(rng):
    x = round(rng.uniform(1, 9999), 4)
    return rng.choice((f"Round {x} to two decimal places.", f"Round {x} to the nearest hundred.",
                       f"Round {x} to three significant figures."))


def _m_negatives(rng):
    a, b, c = rng.randint(-50, 50), rng.randint(-50, 50), rng.randint(-50, 50)
    return f"What is {a} - ({b}) + ({c})?"


def _m_consecutive(rng):
    n, k = rng.randint(5, 200), rng.choice((2, 3, 4))
    total = k * n + k * (k - 1) // 2
    return f"The sum of {k} consecutive whole numbers is {total}. What are the numbers?"


def _m_angles(rng):
    a, b = rng.randint(20, 90), rng.randint(20, 70)
    return rng.choice((f"Two angles of a triangle are {a} and {b} degrees. What is the third angle?",
                       f"What is each interior angle of a regular polygon with {rng.randint(5, 12)} sides?"))


def _m_pipes(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return (f"One pipe fills a pool in {a} hours and another fills it in {b} hours. How long do they take "
            "together?")


def _m_class_average(rng):
    n1, n2 = rng.randint(10, 30), rng.randint(10, 30)
    a1, a2 = rng.randint(55, 95), rng.randint(55, 95)
    return (f"A class of {n1} students averaged {a1} points on a test and another class of {n2} averaged {a2}. "
            "What is the average of all the students together?")


def _m_dice(rng):
    s = rng.randint(3, 11)
    return rng.choice((f"Two fair dice are rolled. What is the probability that they add up to {s}?",
                       f"A fair coin is tossed {rng.randint(2, 5)} times. What is the probability of getting "
                       "heads every time?"))


def _m_choose(rng):
    n = rng.randint(5, 15)
    k = rng.randint(2, min(5, n - 1))
    return rng.choice((f"How many ways are there to choose {k} people from a group of {n}?",
                       f"In how many orders can {k} runners finish a race out of {n} runners?"))


def _m_factorial(rng):
    return f"What is {rng.randint(4, 10)} factorial?"


def _m_remainder(rng):
    return f"What is the remainder when {rng.randint(100, 9999)} is divided by {rng.randint(3, 19)}?"


def _m_quadratic(rng):
    r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
    b, c = -(r1 + r2), r1 * r2
    return f"Solve x^2 {'+' if b >= 0 else '-'} {abs(b)}x {'+' if c >= 0 else '-'} {abs(c)} = 0."


def _m_system(rng):
    x, y = rng.randint(-8, 12), rng.randint(-8, 12)
    a, b, c, d = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6)
    if a * d == b * c:
        d += 1
    def term(coef: int, var: str) -> str:
        return var if coef == 1 else f"{coef}{var}"

    return (f"Solve the system of equations: {term(a, 'x')} + {term(b, 'y')} = {a * x + b * y} and "
            f"{term(c, 'x')} - {term(d, 'y')} = {c * x - d * y}.")


def _m_slope(rng):
    x1, y1, x2, y2 = rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(-9, 9)
    if x1 == x2:
        x2 += 1
    return f"What is the slope of the line through ({x1}, {y1}) and ({x2}, {y2})? Write the equation of the line."


def _m_compound(rng):
    p, r, t = rng.randint(5, 100) * 100, rng.choice((2, 3, 4, 5, 6)), rng.randint(2, 10)
    return f"${p} is invested at {r}% per year, compounded yearly. How much is it worth after {t} years?"


def _m_unit_price(rng):
    n1, n2 = rng.choice((4, 6, 8)), rng.choice((10, 12, 15))
    p1, p2 = round(n1 * rng.uniform(0.3, 1.5), 2), round(n2 * rng.uniform(0.3, 1.5), 2)
    item = rng.choice(("yoghurts", "batteries", "rolls", "pens", "soap bars"))
    return f"A pack of {n1} {item} costs ${p1} and a pack of {n2} costs ${p2}. Which pack is cheaper per item?"


def _m_roman(rng):
    n = rng.randint(4, 3999)
    return rng.choice((f"Write {n} in Roman numerals.", f"What number is the Roman numeral {_roman(n)}?"))


def _roman(n: int) -> str:
    out = ""
    for value, sym in ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
                       (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        while n >= value:
            out, n = out + sym, n - value
    return out


def _m_trapezoid(rng):
    a, b, h = rng.randint(3, 30), rng.randint(3, 30), rng.randint(2, 20)
    return rng.choice((f"A trapezoid has parallel sides of {a} m and {b} m and a height of {h} m. What is its area?",
                       f"A triangle has a base of {a} cm and a height of {h} cm. What is its area?"))


def _m_tip(rng):
    bill, tip, n = round(rng.uniform(20, 300), 2), rng.choice((10, 12, 15, 18, 20)), rng.randint(2, 8)
    return (f"A restaurant bill is ${bill}. The group adds a {tip}% tip and splits it evenly among {n} people. "
            "How much does each person pay?")


def _m_change(rng):
    prices = [round(rng.uniform(0.5, 15), 2) for _ in range(rng.randint(2, 4))]
    paid = rng.choice((20, 50, 100))
    return (f"{_name(rng)} buys items costing ${', $'.join(map(str, prices))} and pays with ${paid}. "
            "How much change is due?")


def _m_map_scale(rng):
    scale, cm = rng.choice((10000, 25000, 50000, 100000)), rng.randint(2, 30)
    return f"On a map with a scale of 1:{scale}, two towns are {cm} cm apart. How far apart are they in reality?"


def _m_hex(rng):
    n = rng.randint(16, 4095)
    return rng.choice((f"Convert {n} to hexadecimal.", f"Convert the hexadecimal number {n:X} to decimal."))


def _m_buses(rng):
    a, b = rng.sample((6, 8, 9, 10, 12, 15, 18, 20), 2)
    city = rng.choice(CITIES)
    return (f"In {city}, one bus line leaves the station every {a} minutes and another every {b} minutes. They "
            "both leave at 8:00. When do they next leave together?")


def _m_distance_time(rng):
    n, km, minutes = _name(rng), rng.randint(3, 60), rng.randint(10, 150)
    return f"{n} cycles {km} km in {minutes} minutes. What is the average speed in km/h?"


MATH_GENERATORS = (
    _m_inventory, _m_distance, _m_discount, _m_arith, _m_linear, _m_average, _m_rectangle, _m_pages, _m_minutes,
    _m_recipe, _m_fraction, _m_sequence, _m_gcd, _m_prime, _m_tank, _m_workers, _m_sum_diff, _m_circle,
    _m_savings, _m_interest, _m_squares, _m_packs, _m_stats, _m_binary, _m_percent, _m_age, _m_speed_time,
    _m_triangle, _m_convert, _m_celsius, _m_clock, _m_ratio, _m_percent_change, _m_box, _m_cylinder, _m_powers,
    _m_sqrt, _m_order_ops, _m_fraction_ops, _m_decimals, _m_rounding, _m_negatives, _m_consecutive, _m_angles,
    _m_pipes, _m_class_average, _m_dice, _m_choose, _m_factorial, _m_remainder, _m_quadratic, _m_system, _m_slope,
    _m_compound, _m_unit_price, _m_roman, _m_trapezoid, _m_tip, _m_change, _m_map_scale, _m_hex, _m_buses,
    _m_distance_time,
)


def math_prompt(rng: random.Random) -> tuple[str, str]:
    gen = rng.choice(MATH_GENERATORS)
    return gen.__name__.removeprefix("_m_"), gen(rng) + rng.choice(STEP_SUFFIXES)
