"""The fixed text of the start-up calibration pass (tqattn/engine/calibration.py).

Written for this project (no third-party text), and deliberately mixed — prose, dialogue, a
list, code, JSON, arithmetic, a chat turn — so that the keys it produces look like those of
ordinary prompts rather than of one genre. It shares nothing with the evaluation texts
(Shakespeare, gsm_symbolic solutions). Changing it changes every calibration: the cache key
includes its hash.
"""

TEXT = """\
The harbour town woke slowly that morning. Fog sat on the water like a folded blanket, and the \
fishing boats that should have left at five were still tied two and three deep along the stone \
quay. Mara walked the length of it with her hands in her coat pockets, counting hulls out of \
habit: the blue one with the cracked wheelhouse window, the two identical trawlers that belonged \
to the Ostrander brothers, the old ferry that nobody had moved since the bridge opened. At the \
end of the quay the harbour master's office showed a single yellow light.

"You're early," said Tomas, without looking up from the radio. "Nothing's going out until this \
lifts. Coast guard says noon, maybe later."
"I'm not here for the boats," she said. "I'm here about the ledger."
He looked up then. "Which ledger?"
"The one with the mooring fees from last winter. Half the entries are in pencil and the other \
half are missing. The council wants a clean copy by Friday, and I would rather not guess."

Tomas sighed, pushed his chair back and pulled a grey box file from the shelf behind him. Inside \
were receipts held together with rubber bands, a few postcards, and a notebook whose cover had \
been repaired with tape so many times that it was more tape than cardboard.

Notes for the spring meeting:
1. Repaint the safety lines on the north steps before the first tourist ferry.
2. Replace the two lamps at the fuel dock; both flicker in wet weather.
3. Ask the county about dredging the inner basin, which lost almost half a metre of depth.
4. Publish the new fee table: small boats 14 per week, medium 22, large 35, and a 10 percent \
discount for boats that stay the whole season.
5. Decide who keeps the spare keys when the office is closed.

A short history of the tide tables. For most of the nineteenth century the tables printed in \
coastal almanacs were computed by hand, harmonic constituent by constituent, and a single year \
for a single port could take a clerk several weeks. The mechanical tide predictor changed that: \
a frame of pulleys and gears, each gear turning at the period of one constituent, summed the \
cosines on a drum of paper. Engineers in several countries built their own versions, and some of \
them remained in use until electronic computers replaced them in the 1960s. The method itself \
did not change much; only the speed of the arithmetic did.

def moving_average(values, window):
    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    total, out = 0.0, []
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.items.get(name, 0)
        if count > have:
            raise KeyError(f"only {have} of {name} left")
        self.items[name] = have - count

{"station": "north-quay", "readings": [{"time": "06:00", "level_m": 2.41, "temp_c": 9.8}, \
{"time": "06:30", "level_m": 2.63, "temp_c": 9.9}, {"time": "07:00", "level_m": 2.85, \
"temp_c": 10.1}], "status": "ok", "battery": 0.87}

A worked example. A cyclist rides 18 kilometres to the next village at an average of 24 \
kilometres per hour and comes back against the wind at 15 kilometres per hour. The trip out \
takes 18 / 24 = 0.75 hours, the trip back 18 / 15 = 1.2 hours, so the round trip of 36 \
kilometres takes 1.95 hours and the average speed is 36 / 1.95, about 18.46 kilometres per hour \
- less than the mean of the two speeds, because more time is spent at the slower one. In \
general, for equal distances the average speed is the harmonic mean 2ab / (a + b).

Let f(x) = 3x^2 - 12x + 7. Its derivative is f'(x) = 6x - 12, which is zero at x = 2, and \
f(2) = 12 - 24 + 7 = -5. Since the second derivative is 6 > 0, the point (2, -5) is the minimum. \
The roots solve 3x^2 - 12x + 7 = 0: x = (12 +- sqrt(144 - 84)) / 6 = 2 +- sqrt(60) / 6, that \
is approximately 3.291 and 0.709.

User: Can you explain what a hash table is in two sentences?
Assistant: A hash table stores key-value pairs in an array and uses a hash function to turn each \
key into the index where its value lives, so lookups take about the same time no matter how \
many items there are. When two keys land on the same index, the table resolves the collision, \
for example by keeping a short list at that slot or by probing for the next free one.
User: And when would I not use one?
Assistant: When you need the keys in sorted order, when memory is very tight, or when an \
adversary can choose keys that collide on purpose; a balanced tree or a sorted array is often \
the better choice then.

The committee met again in March. Attendance was lower than in January - eleven members instead \
of seventeen - but the agenda was shorter too. The treasurer reported that the repairs to the \
roof had cost 4,350, about 600 less than the estimate, mostly because the scaffolding could be \
borrowed from the school. A motion to move the summer fair from the park to the harbour was \
discussed at length and finally postponed: several members worried about parking, others about \
the weather, and nobody could say whether the fire brigade would lend their tent again.

Weather summary for the week: Monday overcast, 11 degrees, light rain after six. Tuesday \
clearing, 13 degrees, wind from the west at 20 km/h. Wednesday sunny, 15 degrees. Thursday \
fog in the morning, 12 degrees. Friday showers, 10 degrees, gusts up to 45 km/h on the coast.

Recipe notes (bread, one loaf): 500 g flour, 340 g water, 10 g salt, 3 g dried yeast. Mix, \
rest 30 minutes, fold four times at half-hour intervals, shape, proof in the fridge overnight, \
bake at 240 degrees for 20 minutes with the lid on and 20 without. If the crust comes out pale, \
bake longer; if the crumb is dense, the dough was probably too cold when it went in.

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY spent DESC
LIMIT 20;

Quelques phrases pour finir : le brouillard s'est leve vers midi, les bateaux sont sortis un \
par un, et le port est redevenu calme. Am Abend kamen die ersten zurueck, schwer beladen, und \
die Moewen folgten ihnen bis in das Becken. By the time the lamps came on, Mara had copied the \
last page of the ledger, checked every sum twice, and found that the missing entries added up \
to exactly the amount the council had been asking about for a year.
"""
