"""English text the fixture tokenizer is trained on (written for blaze; no third-party text).

Varied on purpose: chat turns, instructions, invoices and support tickets, JSON-looking state, numbers
and code, so the trained byte-level BPE has merges for the kinds of text blaze feeds a model and token
counts come out realistic.
"""

CORPUS = r"""
The speed of light in a vacuum is 299,792,458 metres per second. Light from the Sun takes about eight
minutes and twenty seconds to reach the Earth, and about one and a quarter seconds to reach the Moon.
A spider has eight legs, an insect has six, and a crab has ten if you count its two claws.
Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees Celsius. At the top of a high
mountain it boils at a lower temperature, because the air pressure there is lower.
The capital of France is Paris. The capital of Japan is Tokyo. The capital of Canada is Ottawa, not
Toronto, although Toronto is the larger city. Australia's capital is Canberra.

User: What is the tallest mountain on Earth?
Assistant: Mount Everest, at 8,849 metres above sea level.
User: Can you explain that in more detail?
Assistant: Sure. Mount Everest sits on the border between Nepal and China. Its height was measured
again in 2020 by survey teams from both countries. Climbers usually start from base camps on either
side, and most attempts happen in May, when the winds at the summit are calmer.

Please answer briefly. Answer in as few words as possible. Answer in great detail, with examples and
background. Explain your reasoning step by step. Give one short sentence. Use a friendly tone.
Write a list of three items. Summarise the text below in two lines. Translate the sentence into French.
Be concise. Be thorough. Do not repeat yourself. Stop when the question has been answered.

Invoice INV-2041 from Northwind Supplies was issued on 3 March and is due on 2 April. The amount due
is $1,250.00 and nothing has been paid yet. The customer asked for a payment plan on 5 April.
Invoice INV-2042 was paid in full on 28 February. Invoice INV-2043 is disputed: the customer says the
delivery arrived damaged and wants a refund of $310.50.
Status options: paid, overdue, disputed, pending. The invoice is overdue when the due date has passed
and the balance is greater than zero.

Support ticket 88231: "My password reset email never arrives. I checked the spam folder twice."
Priority: high. Category: account access. The agent replied within 15 minutes and the issue was
resolved after the address on file was corrected.
Support ticket 88232: "The app crashes when I upload a photo larger than 20 MB." Priority: medium.
Category: bug report. Steps to reproduce were attached.
Is the customer angry? Is the request urgent? Does the message contain personal data? Rate the
sentiment from 0 to 4, where 0 is very negative and 4 is very positive.

{"order_id": 5521, "items": [{"sku": "A-17", "qty": 2, "price": 19.99}, {"sku": "B-03", "qty": 1,
"price": 5.25}], "shipping": "express", "paid": true, "country": "DE"}
{"user": {"name": "Ada", "age": 36, "plan": "pro"}, "events": ["login", "upload", "logout"]}
{"option_id": "true", "description": "The proposition is true or the answer is yes."}
{"option_id": "false", "description": "The proposition is false or the answer is no."}
{"option_id": "0", "description": "not at all"} {"option_id": "1", "description": "slightly"}
{"option_id": "2", "description": "moderately"} {"option_id": "3", "description": "very"}

def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

import json
with open("data.json") as handle:
    data = json.load(handle)

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly
quick daft zebras jump. Sphinx of black quartz, judge my vow.

Photosynthesis is the process plants use to turn sunlight, water and carbon dioxide into sugar and
oxygen. It happens mostly in the leaves, inside small structures called chloroplasts, which contain
the green pigment chlorophyll.
The heart pumps blood through the body. Arteries carry blood away from the heart and veins carry it
back. An adult heart beats about seventy times a minute at rest.
Rain forms when water vapour in clouds condenses into droplets that grow heavy enough to fall.
Snow forms when the temperature in the cloud is below freezing and the vapour turns straight to ice.

A good recipe for pancakes: mix two cups of flour, two eggs, one and a half cups of milk, a spoon of
sugar and a pinch of salt. Rest the batter for ten minutes, then cook each pancake for about a minute
on each side in a hot, lightly oiled pan.
To plant a tree, dig a hole twice as wide as the root ball, set the tree at the same depth it grew
in the pot, fill the hole with soil, and water it deeply once a week during the first summer.

The meeting is moved to Thursday at 10:30. Please bring the quarterly report and the budget draft.
Thanks for your message! I will get back to you tomorrow morning.
We are sorry for the delay. Your package left our warehouse today and should arrive within 3 days.
Dear team, the server maintenance window starts at 22:00 UTC and lasts about two hours.

History: the printing press was developed in Europe around 1440. The first powered flight took place
in 1903. The first person walked on the Moon in 1969. The World Wide Web was proposed in 1989.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, fifty,
hundred, thousand, million. 1 2 3 4 5 6 7 8 9 10 11 12 15 20 25 30 42 50 64 99 100 128 256 1024.
Days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Months: January, February,
March, April, May, June, July, August, September, October, November, December.
Colours: red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, pink.

Question: Which option best describes the image? Options: a cat, a dog, a car, a tree.
Answer: a cat. The image shows a small grey cat sitting on a wooden chair near a window.
Question: Does the document mention a deadline? Answer: yes, the deadline is Friday, 14 June.
Question: How confident are you? Answer: fairly confident, about eighty percent.

Read the complete state and schema. Decide every field jointly. Each answer must be exactly one of
that field's allowed options.
STATE: SCHEMA FIELDS: FIELD ID: TYPE: INSTRUCTION: ALLOWED OPTIONS: OPTION END FIELD
JOINT SCHEMA DECISIONS: noul choice score
"""
