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


# ------------------------------------------------------------------------------------------- second generation

WORDS = ("ephemeral", "ubiquitous", "serendipity", "pragmatic", "meticulous", "resilient", "ambiguous", "candid",
         "frugal", "tenacious", "eloquent", "nostalgia", "paradox", "benevolent", "lethargic", "empathy",
         "whimsical", "diligent", "obsolete", "verbose", "mundane", "gregarious", "skeptical", "tangible")
LANGUAGES = ("Spanish", "French", "German", "Italian", "Portuguese")
PHRASES = ("Where is the train station?", "How much does this cost?", "I would like a table for two.",
           "Could you speak more slowly, please?", "I am allergic to nuts.", "What time does the museum open?",
           "Thank you for your help.", "Is this seat free?", "I lost my keys.", "Happy new year!")
FLAWED_SENTENCES = (
    "Me and him goes to the library every tuesday.", "Their going to the park after lunch.",
    "She don't like coffee in the morning.", "The team have finished there work.",
    "Each of the students have a laptop.", "I seen that film last week.", "Its raining since this morning.",
    "Between you and I, the plan is risky.", "He runned to the shop and buyed bread.",
    "The informations you gave was very useful.", "Less people came then we expected.",
)
BOOK_TOPICS = ("the history of science", "personal finance", "learning to think clearly", "space exploration",
               "the ocean", "productivity", "ancient Rome", "climate", "mathematics for fun", "the human brain",
               "leadership", "design", "programming", "world religions", "economics")
EVENTS = ("a study schedule for final exams", "a surprise party for a coworker", "a team offsite for ten people",
          "a garage sale", "a neighbourhood clean-up day", "a book club's first meeting", "a charity bake sale",
          "a family reunion", "a weekend hackathon at school", "a move to a new apartment")
STATES = ("starting a new job", "learning to code at forty", "recovering from an injury", "training for a race",
          "moving abroad", "studying for a hard exam", "caring for a newborn", "looking for work")
RIDDLE_THINGS = ("a clock", "a shadow", "an echo", "a river", "a candle", "a map", "a keyboard", "the moon",
                 "a piano", "an egg")
JOKE_TOPICS = ("programmers", "cats", "mathematics", "the weather", "coffee", "libraries", "trains", "dinosaurs")
MYTHS = ("we only use ten percent of our brains", "goldfish have a three-second memory",
         "lightning never strikes the same place twice", "bats are blind", "the Great Wall of China is visible "
         "from space", "cracking your knuckles causes arthritis", "sugar makes children hyperactive",
         "bulls are angered by the colour red", "we lose most of our body heat through our heads",
         "chameleons change colour to match their background")
PROCESSES = ("a bill becomes a law", "a plane takes off", "bread dough rises", "a refrigerator keeps food cold",
             "a vaccine trains the immune system", "a search engine ranks pages", "a bee colony finds food",
             "a credit card payment goes through", "a letter travels through the postal system",
             "a hurricane forms", "a seed grows into a plant", "a 3D printer builds an object")
TRADEOFFS = ("nuclear power", "online classes", "living alone", "a standing desk", "open-plan offices",
             "self-driving cars", "working night shifts", "buying a used car", "learning two languages at once",
             "keeping a pet rabbit", "a gap year before university", "smart home devices")
TRAITS = ("stubborn but kind", "curious and clumsy", "quiet and observant", "cheerful and forgetful",
          "ambitious and impatient", "brave but shy", "honest to a fault")
SHOP_PEOPLE = (("a customer", "a bike shop mechanic", "a squeaky brake"),
               ("a guest", "a hotel receptionist", "a noisy room"),
               ("a customer", "a phone shop assistant", "a cracked screen"),
               ("a patient", "a pharmacist", "a missing prescription"),
               ("a traveller", "an airline agent", "a delayed flight"),
               ("a student", "a librarian", "an overdue book"))
CAUSES = ("a city recycling campaign", "a blood donation drive", "a school reading week", "a tree-planting day",
          "a campaign to save water", "a local animal shelter")
ESSAY_TOPICS = ("the role of museums today", "why sleep matters", "how the internet changed shopping",
                "the value of learning history", "public libraries", "video games as art", "urban gardening",
                "the future of work", "the importance of bees", "why people collect things")
CHECKLISTS = ("moving house", "hosting a dinner for eight", "the first week at a new job",
              "closing a small office for the holidays", "a long car journey", "setting up a new laptop",
              "starting a small online shop", "preparing a house for winter", "a school science fair")
ANALOGY_DOMAINS = ("cooking", "football", "gardening", "traffic", "a library", "music", "building a house")
CATEGORY_SETS = (
    ("mammals, birds or fish", "salmon, eagle, dolphin, sparrow, tuna, bat, penguin, shark, horse"),
    ("renewable or non-renewable energy", "coal, wind, solar, natural gas, hydropower, oil, geothermal"),
    ("fruits or vegetables", "tomato, carrot, apple, cucumber, banana, spinach, pumpkin, pear"),
    ("input or output devices", "keyboard, monitor, microphone, printer, mouse, speaker, scanner"),
    ("conductors or insulators", "copper, rubber, glass, aluminium, wood, silver, plastic"),
    ("nouns, verbs or adjectives", "run, happy, table, quickly-moving, sing, blue, river, write"),
)
GOALS = ("a science fair project", "a birthday gift for a teenager", "a team-building activity",
         "a short film to make with a phone", "a podcast episode", "a small business to run on weekends",
         "a school fundraiser", "a first programming project", "a low-cost date night", "a blog post series")


def _define(rng):
    return rng.choice(("What does the word '{w}' mean? Use it in a sentence.",
                       "Give me five synonyms for '{w}', with a short example for each.",
                       "What is the opposite of '{w}'? Explain the nuance.")).format(w=rng.choice(WORDS))


def _translate(rng):
    return f"How do you say '{rng.choice(PHRASES)}' in {rng.choice(LANGUAGES)}? Give the pronunciation too."


def _grammar(rng):
    return rng.choice(("Is this sentence correct? '{s}' If not, fix it and explain.",
                       "Correct the grammar of this sentence: '{s}'")).format(s=rng.choice(FLAWED_SENTENCES))


def _books(rng):
    return f"Recommend {rng.choice((3, 4, 5))} books about {rng.choice(BOOK_TOPICS)} and say why each is worth reading."


def _plan(rng):
    return rng.choice(("Help me plan {e}.", "Make a plan for {e}, with a rough timeline.")).format(
        e=rng.choice(EVENTS))


def _encourage(rng):
    return f"Write a short, encouraging message for a friend who is {rng.choice(STATES)}."


def _riddle(rng):
    return rng.choice(("Tell me a riddle about {t}, then give the answer.",
                       "Write a riddle whose answer is {t}.")).format(t=rng.choice(RIDDLE_THINGS))


def _joke(rng):
    return f"Tell me a clean joke about {rng.choice(JOKE_TOPICS)}."


def _myth(rng):
    return rng.choice(("Is it true that {m}?", "Someone told me that {m}. Is that right?")).format(
        m=rng.choice(MYTHS))


def _process(rng):
    return f"Describe how {rng.choice(PROCESSES)}, step by step."


def _tradeoffs(rng):
    return rng.choice(("What are the advantages and disadvantages of {t}?", "Is {t} a good idea? Weigh it up.")
                      ).format(t=rng.choice(TRADEOFFS))


def _character(rng):
    return f"Describe a fictional character who is {rng.choice(TRAITS)} and works as {rng.choice(JOBS)}."


def _service_dialogue(rng):
    a, b, problem = rng.choice(SHOP_PEOPLE)
    return f"Write a short conversation between {a} and {b} about {problem}."


def _slogans(rng):
    return f"Write {rng.choice((3, 5))} short slogans for {rng.choice(CAUSES)}."


def _outline(rng):
    return rng.choice(("Write an outline for an essay about {t}.", "Write the opening paragraph of an essay about "
                       "{t}.")).format(t=rng.choice(ESSAY_TOPICS))


def _checklist(rng):
    return f"Make a checklist for {rng.choice(CHECKLISTS)}."


def _analogy(rng):
    return f"Explain {rng.choice(CONCEPTS)} using an analogy from {rng.choice(ANALOGY_DOMAINS)}."


def _classify(rng):
    kinds, items = rng.choice(CATEGORY_SETS)
    return f"Sort these into {kinds}: {items}."


def _brainstorm(rng):
    return f"Brainstorm {rng.choice((5, 8, 10))} ideas for {rng.choice(GOALS)}."


def _timeline(rng):
    return rng.choice(("Give a short timeline of {c}.", "How did our understanding of {c} develop over time?")
                      ).format(c=rng.choice(CONCEPTS))


def _teach(rng):
    return (f"I am teaching {rng.choice(AUDIENCES)} about {rng.choice(CONCEPTS)}. Suggest a short activity that "
            "makes the idea stick.")


CHAT_GENERATORS = (_explain, _what_is, _tips, _story, _poem, _email, _compare, _how_to, _trip, _names,
                   _opinion, _job, _list, _dialogue, _define, _translate, _grammar, _books, _plan, _encourage,
                   _riddle, _joke, _myth, _process, _tradeoffs, _character, _service_dialogue, _slogans, _outline,
                   _checklist, _analogy, _classify, _brainstorm, _timeline, _teach)


# Format requests users add to a question; "" (none) is the most common.
CHAT_SUFFIXES = ("", "", "", "", " Keep it under 100 words.", " Use simple words.", " Use a numbered list.",
                 " Include one concrete example.", " Be concise.", " Answer in two short paragraphs.",
                 " Write it for a general audience.", " Add a one-line summary at the end.")


def chat_prompt(rng: random.Random) -> tuple[str, str]:
    gen = rng.choice(CHAT_GENERATORS)
    return gen.__name__.lstrip("_"), gen(rng) + rng.choice(CHAT_SUFFIXES)
