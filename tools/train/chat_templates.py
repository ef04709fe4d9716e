"""General chat instructions: templates over word lists written for this project.

`chat_prompt(rng)` returns (template name, prompt text). The lists are deliberately broad (everyday topics,
science, work, travel, writing) so that the regenerated responses cover the kind of chat the server sees.
"""

from __future__ import annotations

import random

CONCEPTS = (
    "photosynthesis", "inflation", "compound interest", "the water cycle", "gravity", "vaccines", "black holes",
    "supply and demand", "machine learning", "the immune system", "plate tectonics", "democracy", "recycling",
    "the greenhouse effect", "electric circuits", "DNA", "the stock market", "time zones", "the internet",
    "encryption", "evolution", "tides", "volcanoes", "the French Revolution", "the Renaissance", "probability",
    "nutrition labels", "credit scores", "solar panels", "earthquakes", "the moon's phases", "antibiotics",
    "rainbows", "static electricity", "sound waves", "the digestive system", "composting", "cloud computing",
    "interest rates", "the Olympic Games", "jazz music", "impressionist painting", "the printing press",
    "coral reefs", "bird migration", "sleep cycles", "batteries", "magnets", "the metric system", "fractions",
    "a budget", "open source software", "version control", "public transport", "wind turbines", "glaciers",
    "the seasons", "memory in the brain", "habits", "negotiation", "first aid", "copyright", "bees",
)
AUDIENCES = ("a beginner", "a ten-year-old", "a busy manager", "a high-school student", "my grandmother",
             "someone new to the topic", "a curious teenager")
ACTIVITIES = (
    "learning a new language", "running a first marathon", "saving money", "cooking for a large family",
    "working from home", "studying for exams", "starting a vegetable garden", "taking better photos",
    "keeping a houseplant alive", "public speaking", "learning to code", "writing a novel", "moving to a new city",
    "training a puppy", "reducing screen time", "planning a wedding", "learning the guitar", "sleeping better",
    "staying focused", "making friends as an adult", "preparing for a job interview", "hiking safely",
    "organising a small kitchen", "cycling to work", "reading more books", "learning to swim", "traveling cheaply",
    "keeping a journal", "managing a small team", "baking bread",
)
STORY_HEROES = (
    "a lighthouse keeper", "a robot that wants to paint", "a shy dragon", "an old fisherman", "a lost kitten",
    "a young astronaut", "a baker in a small town", "a detective who is afraid of the dark", "a talking tree",
    "twin sisters", "a retired teacher", "a street musician", "a girl who can hear plants", "a clockmaker",
    "a mail carrier on a mountain", "a penguin who dislikes the cold", "a knight without a horse",
)
STORY_EVENTS = (
    "finds a mysterious map", "loses something important", "meets a stranger on a train", "wins a contest",
    "gets stuck in a snowstorm", "discovers a hidden door", "has to keep a secret", "learns to fly",
    "opens a shop", "goes on a long journey", "makes an unlikely friend", "solves an old puzzle",
)
POEM_SUBJECTS = (
    "autumn leaves", "the sea at night", "a city morning", "friendship", "a cup of coffee", "the first snow",
    "an old bridge", "the stars", "a quiet library", "spring rain", "a train station", "the desert",
    "a cat asleep in the sun", "mountains", "a garden after rain", "the last day of summer",
)
POEM_FORMS = ("a haiku", "a short poem", "a limerick", "a four-line rhyming poem", "a free-verse poem")
EMAIL_CASES = (
    ("my landlord", "a broken heater"), ("my manager", "taking a day off next Friday"),
    ("a colleague", "rescheduling our meeting"), ("a customer", "a delayed order"),
    ("my neighbour", "noise late at night"), ("a teacher", "my child missing school for a week"),
    ("a hotel", "an early check-in"), ("a client", "a new project proposal"),
    ("the city council", "a missing street light"), ("a friend", "returning a borrowed book"),
    ("a recruiter", "following up after an interview"), ("my team", "a change in the release date"),
)
PAIRS = (
    ("tea", "coffee"), ("cats", "dogs"), ("renting", "buying a home"), ("trains", "planes for short trips"),
    ("paper books", "e-readers"), ("Python", "JavaScript"), ("running", "swimming"), ("city life", "country life"),
    ("solar power", "wind power"), ("a laptop", "a desktop computer"), ("saving", "investing"),
    ("working in an office", "working remotely"), ("electric cars", "petrol cars"), ("SQL", "NoSQL databases"),
    ("learning alone", "learning in a class"), ("a tablet", "a notebook for taking notes"),
)
HOW_TO = (
    "boil an egg", "change a flat tyre", "write a good résumé", "make a simple budget", "back up my photos",
    "unclog a sink", "set up a home Wi-Fi network", "brew a good cup of tea", "iron a shirt",
    "tie a tie", "plan a road trip", "make a weekly meal plan", "clean a laptop keyboard", "start meditating",
    "prepare for a power cut", "write a thank-you note", "choose a good password", "fold a fitted sheet",
    "remove a coffee stain", "learn touch typing", "plant tulip bulbs", "make pancakes without eggs",
)
PLACES = ("Lisbon", "Kyoto", "the Scottish Highlands", "Istanbul", "Mexico City", "Vienna", "Iceland",
          "the Amalfi Coast", "Montreal", "Marrakesh", "Cape Town", "Seoul", "Buenos Aires", "Prague")
NAME_THINGS = ("a bakery", "a podcast about science", "a hiking club", "a pet turtle", "a productivity app",
               "a small bookshop", "a board game cafe", "a school robotics team", "a newsletter about gardening")
OPINION_TOPICS = ("homework for young children", "four-day work weeks", "school uniforms",
                  "banning cars from city centres", "learning Latin at school", "social media for teenagers",
                  "tipping in restaurants", "daylight saving time")
JOBS = ("a nurse", "a software engineer", "a chef", "a pilot", "an architect", "a librarian", "a farmer",
        "a firefighter", "a graphic designer", "an electrician", "a journalist", "a vet")


def _explain(rng):
    return f"Explain {rng.choice(CONCEPTS)} to {rng.choice(AUDIENCES)}."


def _what_is(rng):
    return rng.choice(("What is {c}?", "How does {c} work?", "Why is {c} important?", "Tell me about {c}.",
                       "What are common misconceptions about {c}?")).format(c=rng.choice(CONCEPTS))


def _tips(rng):
    return f"Give me {rng.choice((3, 4, 5, 7))} tips for {rng.choice(ACTIVITIES)}."


def _story(rng):
    length = rng.choice(("a short story", "a very short story", "a bedtime story", "a story in one paragraph"))
    return f"Write {length} about {rng.choice(STORY_HEROES)} who {rng.choice(STORY_EVENTS)}."


def _poem(rng):
    return f"Write {rng.choice(POEM_FORMS)} about {rng.choice(POEM_SUBJECTS)}."


def _email(rng):
    who, about = rng.choice(EMAIL_CASES)
    tone = rng.choice(("a polite", "a short", "a formal", "a friendly"))
    return f"Write {tone} email to {who} about {about}."


def _compare(rng):
    a, b = rng.choice(PAIRS)
    return rng.choice(("Compare {a} and {b}.", "What are the pros and cons of {a} versus {b}?",
                       "Should I choose {a} or {b}? Help me decide.")).format(a=a, b=b)


def _how_to(rng):
    return rng.choice(("How do I {t}?", "Give me step-by-step instructions to {t}.",
                       "What is the easiest way to {t}?")).format(t=rng.choice(HOW_TO))


def _trip(rng):
    return f"Plan a {rng.choice((2, 3, 4, 5, 7))}-day trip to {rng.choice(PLACES)}."


def _names(rng):
    return f"Suggest {rng.choice((5, 8, 10))} names for {rng.choice(NAME_THINGS)}."


def _opinion(rng):
    return rng.choice(("Give arguments for and against {t}.", "Write a short opinion piece about {t}.",
                       "What do people usually say about {t}?")).format(t=rng.choice(OPINION_TOPICS))


def _job(rng):
    return rng.choice(("What does a typical day look like for {j}?", "What skills do you need to become {j}?",
                       "Write a short job advertisement for {j}.")).format(j=rng.choice(JOBS))


def _list(rng):
    return rng.choice((
        "List {n} fun facts about {c}.", "Write a quiz with {n} questions about {c}, with answers.",
        "Make a glossary of {n} terms related to {c}.",
    )).format(n=rng.choice((3, 5, 6)), c=rng.choice(CONCEPTS))


def _dialogue(rng):
    a, b = rng.sample(JOBS, 2)
    return f"Write a short dialogue between {a} and {b} who meet at a party."


CHAT_GENERATORS = (_explain, _what_is, _tips, _story, _poem, _email, _compare, _how_to, _trip, _names,
                   _opinion, _job, _list, _dialogue)


def chat_prompt(rng: random.Random) -> tuple[str, str]:
    gen = rng.choice(CHAT_GENERATORS)
    return gen.__name__.lstrip("_"), gen(rng)
