"""Plain English words that synthetic prompts are built from (seeded random draws of them).

Why words and not random token ids, where a text tokenizer exists: random ids decode to text that tokenizes
back to a different length (vLLM re-encodes and adjusts); words cut at a token boundary read back the same,
so a prompt's length is the one asked for, and every backend can be sent the same text.
"""

WORDS = tuple("""
the of and to in is was for on that with as by at from his her are an be this had not but have which
they were one all their she there been has when who will more no if out so said what up its about into
than them can only other new some could time these two may then do first any my now such like our over
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last might us great old
year off come since against go came right used take three river mountain garden window letter engine
market winter summer morning evening water light stone paper music story number family village table
""".split())
