"""Fifty prompts that ask SmolLM2 to rewrite or correct a given text: the answer copies much of the
prompt, the workload prompt lookup (ngram speculative decoding) is for. 25 short passages with
mistakes, each under two instructions."""

from __future__ import annotations

PASSAGES = [
    "The meeting have been moved to thursday becuase the manager is traveling to Boston on wednesday.",
    "Our team finished the project two weeks early, and the client were very happy with the results.",
    "Please remember to turn of the lights and lock the door when you leave the office tonight.",
    "The recipe calls for two cups of flour, one cup of sugar, three eggs and a pinch of salt.",
    "I has been learning to play the guitar for six months and I can now play five songs.",
    "The library will be closed on monday for maintenance and will reopen on tuesday morning.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures in the mountains.",
    "She dont like coffee, so she usually orders a cup of green tea with honey at the cafe.",
    "The train to London leaves at nine fifteen from platform four, and it arrives at eleven.",
    "Our new software update fix several bugs and makes the app start twice as fast as before.",
    "The children played in the park all afternoon and came home tired, hungry and very happy.",
    "Their going to paint the kitchen blue and replace the old cabinets with new wooden ones.",
    "The museum has a large collection of paintings from the nineteenth century and many old maps.",
    "Remember to backup your files every week, because a broken disk can erase years of work.",
    "The weather forecast says it will rain tomorrow, so bring an umbrella and wear warm clothes.",
    "He wrote a long letter to his grandmother and mailed it from the post office on main street.",
    "Most plants needs sunlight, water and good soil to grow strong and to produce many flowers.",
    "The company announced that it will open three new stores in the city before the end of the year.",
    "I am writing to ask weather the apartment on the second floor is still available for rent.",
    "The cat sleeps on the windowsill every morning and watches the birds in the garden below.",
    "Our flight was delayed by three hours, so we missed the connection and stayed one night in Paris.",
    "The students must submit there essays by friday, and late essays will lose ten points each day.",
    "A good breakfast gives you energy for the morning and helps you concentrate at school or work.",
    "The bridge was build in nineteen twenty and it is still used by thousands of cars every day.",
    "Please send me the report by tomorrow evening so that I can review it before the meeting.",
]
INSTRUCTIONS = [
    "Correct the spelling and grammar mistakes in the following text. Reply with the corrected text only.",
    "Rewrite the following text exactly, word for word, but with the first letter of every day name "
    "capitalised and any mistakes fixed. Reply with the rewritten text only.",
]


def rewrite_prompts() -> list[str]:
    """The fifty user messages, passage by passage."""
    return [f"{instruction}\n\n{passage}" for passage in PASSAGES for instruction in INSTRUCTIONS]
