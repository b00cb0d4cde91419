"""Synthetic, labelled typed-decision records (invoices, support tickets, shipments), generated in code.

Why: blaze's decision canaries need a release whose decisions are *confident and decided by the input*
(random-weight releases sit near ties, where one bf16 rounding step flips an answer). The decision fixture
(`clef_model.decision_fixture`) trains on these records; its held-out split is the labelled evaluation.

Every question's right answer follows from the state: a field value (an invoice's status), the wording of
a message (a ticket about a login problem), or a stated impact (how many users are affected). Each question
has several phrasings; choice, score and noul questions all occur. Records are SystemOne request bodies
plus `labels` ({question id: option id}), the data format of clef-finetune (its `data.py`).

The generator is seeded and uses only Python's `random.Random`, so a seed gives the same records
everywhere. Training and evaluation records come from disjoint random streams *and* disjoint names
(customers, vendors, ticket numbers), so no evaluation record appears in training.
"""

from __future__ import annotations

import random
from typing import Any

MODEL_NAME = "clef-flash"

# -- question templates: id -> (type, phrasings, criteria) -------------------------------------------
INVOICE_STATUS = {
    "paid": "The invoice has been paid in full.",
    "overdue": "The due date has passed and it is unpaid.",
    "draft": "The invoice has not been sent yet.",
}
TICKET_CATEGORY = {
    "billing": "Charges, invoices, refunds or payment methods.",
    "login": "Signing in, passwords or two-factor codes.",
    "outage": "The service is down or failing for the customer.",
}
IMPACT_LEVELS = ["Low: one user, a workaround exists", "Medium: a team is blocked", "High: every customer is affected"]
SHIPMENT_STATUS = {
    "delivered": "The parcel reached the recipient.",
    "in_transit": "The parcel is on its way.",
    "lost": "The carrier cannot find the parcel.",
}

QUESTIONS: dict[str, dict[str, Any]] = {
    "status": {
        "type": "choice",
        "criteria": INVOICE_STATUS,
        "phrasings": [
            "What is the payment status of this invoice?",
            "Has this invoice been paid, is it late, or was it never sent?",
            "Classify the invoice by its payment state.",
        ],
    },
    "overdue": {
        "type": "noul",
        "phrasings": [
            "Is this invoice overdue?",
            "Is payment of this invoice late?",
            "Should accounts receivable chase this invoice as overdue?",
        ],
    },
    "category": {
        "type": "choice",
        "criteria": TICKET_CATEGORY,
        "phrasings": [
            "Which queue should this support ticket go to?",
            "What is the customer's message about?",
            "Route the ticket to the right team.",
        ],
    },
    "impact": {
        "type": "score",
        "criteria": IMPACT_LEVELS,
        "phrasings": [
            "How severe is the impact described in the ticket?",
            "Rate the business impact of this ticket.",
            "How many people does this problem hurt?",
        ],
    },
    "refund": {
        "type": "noul",
        "phrasings": [
            "Does the customer ask for a refund?",
            "Is the customer requesting their money back?",
            "Does this ticket contain a refund request?",
        ],
    },
    "shipment": {
        "type": "choice",
        "criteria": SHIPMENT_STATUS,
        "phrasings": [
            "Where is this shipment now?",
            "What is the delivery status of the parcel?",
            "Summarise the tracking state of this order.",
        ],
    },
    "damaged": {
        "type": "noul",
        "phrasings": [
            "Did the parcel arrive damaged?",
            "Does the tracking note report damage?",
            "Is there a damage claim to open for this order?",
        ],
    },
}

# -- state vocabularies -------------------------------------------------------------------------------
# Names and ids carry no decision information, so the head must learn to ignore them. The training split draws
# them from a large synthetic pool (syllable names, random ids) so that it sees many of them; the dev and eval
# splits use short fixed lists that the training pool never produces (a small, tiny-backbone version of "new
# customers in production"). Ids are random numbers in every split (an id's prefix never tells the split).
_HELDOUT_VENDORS = {
    "dev": ["Mooncake", "Brightline", "Kestrel Foods", "Orbitz Paper", "Quartzly", "Zephyr Tools"],
    "eval": ["Wonka", "Duff", "Monarch", "Pied Piper", "Blue Sun", "Aperture"],
}
_HELDOUT_CUSTOMERS = {
    "dev": ["Wanda", "Xavier", "Yusuf", "Zoe", "Amara", "Bruno"],
    "eval": ["Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor"],
}
_SYLLABLES = ["ka", "lo", "mi", "ne", "ra", "so", "ti", "ve", "da", "gu", "ha", "jo", "be", "fi", "pa", "ze",
              "an", "el", "or", "us", "ik", "em", "al", "in"]
_VENDOR_SUFFIXES = ["", "", " Ltd", " GmbH", " Inc", " & Co", " Supply", " Group"]
SPLITS = ("train", "dev", "eval")


def _synthetic_name(rng: random.Random, split: str) -> str:
    """A training split's name: 2-3 random syllables, never one of the dev or eval names."""
    held = {name.lower() for names in (*_HELDOUT_VENDORS.values(), *_HELDOUT_CUSTOMERS.values()) for name in names}
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name.lower() not in held:
            return name


def _customer(rng: random.Random, split: str) -> str:
    if split == "train":
        return _synthetic_name(rng, split)
    return rng.choice(_HELDOUT_CUSTOMERS[split])


def _vendor(rng: random.Random, split: str) -> str:
    if split == "train":
        return _synthetic_name(rng, split) + rng.choice(_VENDOR_SUFFIXES)
    return rng.choice(_HELDOUT_VENDORS[split])


def _number(rng: random.Random) -> str:
    return f"{rng.randrange(10_000, 1_000_000):06d}"


_STATUS_NOTES = {
    "paid": ["Payment received, thank you.", "Settled by bank transfer."],
    "overdue": ["Reminder sent twice.", "Due date passed last week."],
    "draft": ["Not sent to the customer yet.", "Waiting for approval before sending."],
}
_CATEGORY_MESSAGES = {
    "billing": [
        "I was charged twice for my subscription this month.",
        "The invoice shows the wrong amount for our plan.",
        "My card payment failed but the money left my account.",
        "Why did my bill go up without notice?",
    ],
    "login": [
        "I cannot sign in, the password reset email never arrives.",
        "My two-factor code is rejected every time I log in.",
        "The login page says my account is locked.",
        "I forgot my password and the reset link has expired.",
    ],
    "outage": [
        "The dashboard returns error 500 and nothing loads.",
        "Our API calls are timing out since this morning.",
        "The service is down for us and the status page says nothing.",
        "Every request to the app fails with a gateway error.",
    ],
}
_REFUND_SENTENCES = [
    "Please refund the payment.",
    "I want my money back.",
    "We ask for a full refund.",
]
_IMPACT_TEXT = [
    ["Only I am affected and I found a workaround.", "It affects just my own account; I can wait."],
    ["My whole team is blocked by this.", "Our department of twelve cannot work."],
    ["All of our customers are affected right now.", "Every user of our shop is hit by this."],
]
_AFFECTED = ["one user", "a team", "all customers"]
_CARRIERS = ["DHL", "UPS", "FedEx", "PostNord", "La Poste"]
_SHIPMENT_NOTES = {
    "delivered": ["Delivered to the recipient.", "Handed over at the front door."],
    "in_transit": ["Left the sorting centre.", "On the truck to the destination city."],
    "lost": ["Parcel cannot be located.", "Tracking stopped; carrier reports it missing."],
}
_DAMAGE_NOTES = (["Box in good condition."], ["Box arrived crushed and wet."])


def _question(qid: str, rng: random.Random) -> dict[str, Any]:
    template = QUESTIONS[qid]
    question: dict[str, Any] = {"type": template["type"], "instructions": rng.choice(template["phrasings"])}
    if "criteria" in template:
        criteria = template["criteria"]
        question["criteria"] = dict(criteria) if isinstance(criteria, dict) else list(criteria)
    return question


def _pick_questions(rng: random.Random, qids: list[str]) -> list[str]:
    """A random non-empty subset of a domain's questions, in a random order (the schema varies)."""
    chosen = [qid for qid in qids if rng.random() < 0.7] or [rng.choice(qids)]
    rng.shuffle(chosen)
    return chosen


def _invoice(rng: random.Random, split: str, index: int) -> dict[str, Any]:
    status = rng.choice(list(INVOICE_STATUS))
    state = {
        "invoice": {
            "number": f"INV-{_number(rng)}",
            "vendor": _vendor(rng, split),
            "total": round(rng.uniform(20, 9000), 2),
            "currency": rng.choice(["USD", "EUR", "GBP"]),
            "status": status,
            "note": rng.choice(_STATUS_NOTES[status]),
        }
    }
    answers = {"status": status, "overdue": "true" if status == "overdue" else "false"}
    return _record(rng, f"invoice-{split}-{index}", state, answers)


def _ticket(rng: random.Random, split: str, index: int) -> dict[str, Any]:
    category = rng.choice(list(TICKET_CATEGORY))
    impact = rng.randrange(len(IMPACT_LEVELS))
    refund = category == "billing" and rng.random() < 0.5
    message = " ".join(
        [rng.choice(_CATEGORY_MESSAGES[category]), rng.choice(_IMPACT_TEXT[impact])]
        + ([rng.choice(_REFUND_SENTENCES)] if refund else [])
    )
    state = {
        "ticket": {
            "id": f"T-{_number(rng)}",
            "customer": _customer(rng, split),
            "plan": rng.choice(["free", "pro", "enterprise"]),
            "topic": category,
            "affected": _AFFECTED[impact],
            "wants": "refund" if refund else "a fix",
            "message": message,
        }
    }
    answers = {"category": category, "impact": str(impact), "refund": "true" if refund else "false"}
    return _record(rng, f"ticket-{split}-{index}", state, answers)


def _shipment(rng: random.Random, split: str, index: int) -> dict[str, Any]:
    status = rng.choice(list(SHIPMENT_STATUS))
    damaged = status == "delivered" and rng.random() < 0.5
    state = {
        "order": {
            "order_id": f"ORD-{_number(rng)}",
            "customer": _customer(rng, split),
            "carrier": rng.choice(_CARRIERS),
            "status": status,
            "tracking": rng.choice(_SHIPMENT_NOTES[status]),
            "note": rng.choice(_DAMAGE_NOTES[int(damaged)]),
        }
    }
    answers = {"shipment": status, "damaged": "true" if damaged else "false"}
    return _record(rng, f"shipment-{split}-{index}", state, answers)


def _record(rng: random.Random, record_id: str, state: dict[str, Any], answers: dict[str, str]) -> dict[str, Any]:
    qids = _pick_questions(rng, list(answers))
    return {
        "id": record_id,
        "model": MODEL_NAME,
        "state": state,
        "questions": {qid: _question(qid, rng) for qid in qids},
        "labels": {qid: answers[qid] for qid in qids},
    }


_DOMAINS = (_invoice, _ticket, _shipment)


def generate(count: int, *, seed: int, split: str) -> list[dict[str, Any]]:
    """`count` labelled records of one split ("train", "dev" or "eval"), cycling through the domains.

    Each split has its own random stream and its own names (the training split's synthetic pool never produces
    a dev or eval name), so no record of one split appears in another. "dev" exists to choose the training
    recipe without looking at "eval", the fixture's held-out evaluation.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rng = random.Random(f"blaze-decisions:{seed}:{split}")
    return [_DOMAINS[index % len(_DOMAINS)](rng, split, index) for index in range(count)]
